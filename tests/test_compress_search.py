"""The mixed-bit search picks the smallest measured plan that meets its budget."""

from __future__ import annotations

from converter.compression.search import Point, smallest_meeting


def _point(step: int | None, size: int, ok: bool, uniform: int | None = None) -> Point:
    tag = None if uniform is None else f"lut{uniform}"
    return Point(step, size, 0.0, 0.0, 1.0 if ok else 0.0, ok, uniform_bits=uniform, uniform=tag)


def test_a_uniform_plan_off_the_path_wins_when_it_is_smaller() -> None:
    # As measured on SmolLM2: the path's best plan (4 fp16, 5 lut6, 111 lut8 weights) was
    # larger than uniform lut8, which also met the budget.
    path = [_point(0, 200, True), _point(30, 103, True), _point(31, 102, False)]
    uniform = [_point(None, 101, True, 8), _point(None, 76, False, 6)]
    assert smallest_meeting(path + uniform).uniform_bits == 8


def test_a_path_plan_wins_over_a_larger_uniform_one_and_failing_plans_never_win() -> None:
    path = [_point(0, 200, True), _point(12, 90, True), _point(13, 60, False)]
    uniform = [_point(None, 101, True, 8), _point(None, 50, False, 4)]
    chosen = smallest_meeting(path + uniform)
    assert chosen.step == 12 and chosen.uniform_bits is None


def test_a_one_weight_measurement_from_its_layer_equals_the_whole_model_run() -> None:
    """The scorer starts a one-weight measurement at the weight's layer, from cached inputs;
    that must give exactly what running the whole model gives."""
    import copy

    from tiny_models import build_tiny

    from converter.compression.search import Scorer, palette

    tiny = build_tiny("llama")
    module = copy.deepcopy(tiny.module).eval()
    scorer = Scorer(module, tiny.fixtures, tiny.embed_table, pad_id=0)
    assert scorer.compare() == (0.0, 1.0)
    name = "layers.1.mlp.down.weight"
    fp16 = module.get_parameter(name).detach().half().numpy()
    scorer.set(name, palette(fp16, 2))
    from_layer, whole = scorer.compare(first_layer=1), scorer.compare()
    assert from_layer == whole and whole[0] > 0

import pytest

from shared.errors import LayerRangeError
from shared.files.layers import (
    LayerRange,
    StagePosition,
    balanced_split,
    check_cover,
    parse_layer_range,
    parse_split,
    split_at,
)


@pytest.mark.parametrize("layers,stages,expected", [
    (30, 1, [(0, 30)]),
    (30, 2, [(0, 15), (15, 30)]),
    (30, 4, [(0, 8), (8, 15), (15, 22), (22, 30)]),
    (5, 5, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),
])
def test_split_without_a_head_is_even(layers, stages, expected):
    ranges = balanced_split(layers, stages, 0.0)
    assert [(r.start, r.stop) for r in ranges] == expected
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


@pytest.mark.parametrize("layers,stages,head,expected", [
    (30, 2, 0.0, [(0, 15), (15, 30)]),
    (30, 2, 8.0, [(0, 19), (19, 30)]),  # 19 = 11 layers + an 8-layer head
    (30, 3, 8.0, [(0, 13), (13, 25), (25, 30)]),
    (4, 4, 100.0, [(0, 1), (1, 2), (2, 3), (3, 4)]),  # every stage keeps a layer
    (30, 1, 8.0, [(0, 30)]),
])
def test_balanced_split(layers, stages, head, expected):
    ranges = balanced_split(layers, stages, head)
    assert [(r.start, r.stop) for r in ranges] == expected
    check_cover(ranges, layers)


def test_smollm2_head_costs_about_four_layers(smollm2):
    assert 4.0 < smollm2.config.head_cost_in_layers < 5.0
    assert [str(r) for r in balanced_split(30, 2, smollm2.config.head_cost_in_layers)] == ["0:17", "17:30"]


@pytest.mark.parametrize("layers,stages", [(30, 0), (3, 4)])
def test_split_rejects_impossible(layers, stages):
    with pytest.raises(LayerRangeError):
        balanced_split(layers, stages)


@pytest.mark.parametrize("rng,n,pos", [
    ((0, 30), 30, StagePosition.ONLY), ((0, 10), 30, StagePosition.FIRST),
    ((10, 20), 30, StagePosition.MIDDLE), ((20, 30), 30, StagePosition.LAST),
])
def test_positions(rng, n, pos):
    p = LayerRange(*rng).position(n)
    assert p == pos
    assert p.has_embedding == (rng[0] == 0)
    assert p.has_lm_head == (rng[1] == n)


def test_split_at_and_parse():
    assert [str(r) for r in split_at(30, [7, 19])] == ["0:7", "7:19", "19:30"]
    assert parse_layer_range("10:20", 30) == LayerRange(10, 20)
    assert parse_layer_range(":5", 30) == LayerRange(0, 5)
    assert parse_layer_range("25:", 30) == LayerRange(25, 30)
    for bad in ("10-20", "a:b", "5:3"):
        with pytest.raises(LayerRangeError):
            parse_layer_range(bad, 30)
    with pytest.raises(LayerRangeError, match="past the model"):
        parse_layer_range("0:31", 30)
    with pytest.raises(LayerRangeError):
        split_at(30, [19, 7])


@pytest.mark.parametrize("ranges,message", [
    ([(0, 12), (14, 30)], "layers 12:14 are served by no stage"),
    ([(0, 15), (10, 30)], "layers 10:15 are served twice"),
    ([(0, 15), (15, 29)], "layers 29:30 are served by no stage"),
])
def test_check_cover_names_the_problem(ranges, message):
    with pytest.raises(LayerRangeError, match=message):
        check_cover([LayerRange(*r) for r in ranges], 30)


def test_check_cover_accepts_a_pipeline():
    check_cover(balanced_split(30, 3), 30)


def test_parse_split():
    assert [str(r) for r in parse_split("7,19", 30)] == ["0:7", "7:19", "19:30"]
    for bad in ("7;19", "x", "19,7", "0,5"):
        with pytest.raises(LayerRangeError):
            parse_split(bad, 30)

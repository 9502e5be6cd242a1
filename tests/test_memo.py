"""The host side's bounded memo (dmattn_cute/memo.py)."""

from __future__ import annotations

from dmattn_cute.memo import remember


def test_remember_makes_once_keeps_none_and_empties_when_full() -> None:
    table, made = {}, []

    def make(value):
        return lambda: made.append(value) or value

    assert remember(table, "a", make(1), limit=2) == 1
    assert remember(table, "a", make(2), limit=2) == 1  # a hit: not made again
    assert remember(table, "b", make(None), limit=2) is None
    assert remember(table, "b", make(3), limit=2) is None  # a None value is a hit too
    assert made == [1, None]
    assert remember(table, "c", make(4), limit=2) == 4  # full: emptied, then stored
    assert table == {"c": 4}


def test_remember_for_follows_the_tensor_and_its_version() -> None:
    import torch

    from dmattn_cute.memo import remember_for

    table, made = {}, []
    t = torch.zeros(3)

    def derive(x):
        return lambda: made.append(1) or x.sum().item()

    assert remember_for(table, t, "k", derive(t)) == 0
    assert remember_for(table, t, "k", derive(t)) == 0 and len(made) == 1  # a hit
    t += 1  # in place: its version moves
    assert remember_for(table, t, "k", derive(t)) == 3 and len(made) == 2
    other = t.clone()
    assert remember_for(table, other, "k", derive(other)) == 3 and len(made) == 3
    with torch.inference_mode():
        frozen = torch.ones(2)
    remember_for(table, frozen, "k", derive(frozen))
    remember_for(table, frozen, "k", derive(frozen))
    assert len(made) == 5  # not remembered


def test_remember_for_keeps_live_tensors_and_drops_dead_ones_when_full() -> None:
    """Masks made anew every step, each used by a forward and a backward: what a mask left
    goes with it, so the previous steps' dead masks never fill the table (emptied when full,
    the step's earlier masks were made again for its backward); live ones alone overfilling
    it empty it."""
    import gc

    import torch

    from dmattn_cute.memo import remember_for

    table, made = {}, []
    for _ in range(5):
        layers = [torch.rand(2) for _ in range(3)]
        for _ in ("forward", "backward"):
            for t in layers:
                for key in ("bits", "order"):
                    remember_for(table, t, key, lambda t=t: made.append(1) or t.sum(), limit=8)
        del layers, t
        gc.collect()
        assert not table  # the step's bits went with its masks
    assert len(made) == 5 * 3 * 2
    crowd = [torch.zeros(1) for _ in range(9)]
    for t in crowd:
        remember_for(table, t, "bits", lambda: 0, limit=8)
    assert len(table) == 1


def test_remember_for_holds_a_mask_per_layer_of_a_deep_model() -> None:
    """The default table holds 48 layers' masks, each with a forward and a backward entry."""
    import torch

    from dmattn_cute.memo import remember_for

    table, made = {}, []
    layers = [torch.rand(2) for _ in range(48)]
    for _ in range(3):
        for t in layers:
            for key in ("forward", "backward"):
                remember_for(table, t, key, lambda t=t: made.append(t) or t.sum())
    assert len(made) == 48 * 2


def test_device_values_under_graph_capture(monkeypatch) -> None:
    """While a CUDA graph is captured (memo.capturing), device values (graphs=True): a miss is
    made and not remembered (the graph fills it at its replays); a hit is held for the
    process, past its table's emptying and its tensor's death (the graph reads it at every
    replay); host values are remembered as ever."""
    import gc
    import weakref

    import torch

    from dmattn_cute import memo

    def made(value, log):
        return lambda: log.append(value) or value

    table, log = {}, []
    monkeypatch.setattr(memo, "capturing", lambda: True)
    assert memo.remember(table, "a", made(torch.zeros(1), log), graphs=True) is log[-1]
    assert table == {}  # made in the capture: not remembered
    assert memo.remember(table, "h", made(3, log)) == 3 and table == {"h": 3}  # a host value
    monkeypatch.setattr(memo, "capturing", lambda: False)
    value = memo.remember(table, "a", made(torch.ones(1), log), graphs=True)
    monkeypatch.setattr(memo, "capturing", lambda: True)
    assert memo.remember(table, "a", made(None, log), graphs=True) is value and len(log) == 3
    alive = weakref.ref(value)
    table.clear()
    del value
    gc.collect()
    assert alive() is not None  # held for the graph

    mask, owned = torch.zeros(2), {}
    assert memo.remember_for(owned, mask, "k", made(torch.zeros(1), log), graphs=True) is log[-1]
    assert owned == {}
    monkeypatch.setattr(memo, "capturing", lambda: False)
    bits = memo.remember_for(owned, mask, "k", made(torch.ones(2), log), graphs=True)
    monkeypatch.setattr(memo, "capturing", lambda: True)
    assert memo.remember_for(owned, mask, "k", made(None, log), graphs=True) is bits
    alive = weakref.ref(bits)
    del mask, bits
    gc.collect()
    assert owned == {} and alive() is not None  # its mask gone, the graph's copy kept

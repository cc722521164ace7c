"""An in-place scatter (a KV cache's update: ``index_copy_``, ``index_put_``, ``scatter_``, ...)
moves what it writes, not the whole tensor it writes into; its out-of-place form copies the
tensor first and is charged that copy. Compiled, a graph input's functional scatter (or a view's
``slice_scatter``/``select_scatter``) and the ``copy_`` back into it run as the in-place write
(torch_bridge/compile/reinplace.py), with the values CPU gives."""

from __future__ import annotations

import pytest
import torch

import torch_bridge.compile as neuron_compile
from torch_bridge import _torch
from torch_bridge.compile.reinplace import reinplace_input_updates

neuron_compile.register()

CACHE = (1, 8, 2048, 64)  # one layer's K cache: 8 heads x 2,048 positions x 64, bf16 (2 MiB)


def _charged(fn) -> list[tuple[str, str, float]]:
    fn()  # (first calls simulate their kernels; the second is what every call costs)
    torch.neuron.synchronize()
    with torch.neuron.report_scope() as scope:
        fn()
        torch.neuron.synchronize()
    return [(r.op, r.kernel, r.time_us) for r in scope.report.rows]


def _operands(device: str):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(CACHE, generator=g).to(device, torch.bfloat16)
    src = torch.randn(1, 8, 1, 64, generator=g).to(device, torch.bfloat16)
    idx = torch.tensor([5], device=device)
    index = torch.zeros(1, 8, 1, 64, dtype=torch.long, device=device)
    return x, src, idx, index


CALLS = {  # op: (the in-place call, the out-of-place call)
    "index_copy": (lambda x, s, i, j: x.index_copy_(2, i, s), lambda x, s, i, j: x.index_copy(2, i, s)),
    "index_add": (lambda x, s, i, j: x.index_add_(2, i, s), lambda x, s, i, j: x.index_add(2, i, s)),
    "scatter": (lambda x, s, i, j: x.scatter_(2, j, s), lambda x, s, i, j: x.scatter(2, j, s)),
    "scatter_add": (lambda x, s, i, j: x.scatter_add_(2, j, s), lambda x, s, i, j: x.scatter_add(2, j, s)),
    "index_fill": (lambda x, s, i, j: x.index_fill_(2, i, 1.0), lambda x, s, i, j: x.index_fill(2, i, 1.0)),
    "_index_put_impl_": (lambda x, s, i, j: x.index_put_((torch.zeros_like(i), torch.zeros_like(i), i), s[0, 0, 0]),
                         None),
}


@pytest.mark.parametrize("first", ["inplace", "functional"])
@pytest.mark.parametrize("op", list(CALLS))
def test_an_inplace_scatter_moves_what_it_writes(op, first):
    x, src, idx, index = _operands("neuron")
    inplace, functional = CALLS[op]
    calls = {"inplace": lambda: inplace(x, src, idx, index)}
    if functional is not None:
        calls["functional"] = lambda: functional(x, src, idx, index)
    order = sorted(calls, key=lambda k: k != first)  # either may teach the fast path its signature first
    charged = {k: _charged(calls[k]) for k in order}
    row, = [r for r in charged["inplace"] if r[0].rstrip("_") == op.rstrip("_")]
    full = [r for r in _charged(lambda: x.mul_(1.0)) if r[0] == "mul"][0][2]  # one pass over the cache
    assert row[2] < 0.5 * full, (op, row, full)
    if functional is not None:  # the copy of self first (in its kernel or as a clone): a pass over the cache
        total = sum(r[2] for r in charged["functional"])
        assert total > 2 * row[2] and total >= 0.5 * full, (op, charged["functional"], row, full)


def test_an_inplace_scatter_costs_the_same_without_values():
    def run():
        x, src, idx, index = _operands("neuron")
        return _charged(lambda: x.index_copy_(2, idx, src)), _charged(lambda: x.index_copy(2, idx, src))
    eager = run()
    with torch.neuron.timing_only():
        fake = run()
    assert fake == eager


def test_a_boolean_mask_put_is_charged_a_pass_over_the_tensor():
    """Where the indices are a mask the build cannot count its writes without its values: a pass
    over the tensor, as before."""
    x = torch.zeros(CACHE, dtype=torch.bfloat16, device="neuron")
    mask = torch.zeros(CACHE, dtype=torch.bool, device="neuron")
    full = [r for r in _charged(lambda: x.mul_(1.0)) if r[0] == "mul"][0][2]
    rows = [r for r in _charged(lambda: x.index_put_((mask,), torch.tensor(1.0, dtype=torch.bfloat16,
                                                                            device="neuron"))) if "index_put" in r[0]]
    assert rows and max(r[2] for r in rows) >= 0.5 * full


def _cache_update(cache: torch.Tensor, pos: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    cache.index_copy_(2, pos, k)  # as Hugging Face's StaticCache.update writes a decode step's key
    return cache[:, :, :8].float().sum()


@pytest.mark.parametrize("op", ["index_copy_", "index_put_", "slice", "select"])
def test_a_compiled_cache_update_writes_in_place_with_cpu_s_values(op):
    def update(cache, pos, k):
        if op == "index_copy_":
            cache.index_copy_(2, pos, k)
        elif op == "index_put_":
            cache[:, :, pos] = k
        elif op == "slice":  # (functionalized: slice_scatter and a copy_ back)
            cache[:, :, 5:6] = k
        else:
            cache[:, :, 5] = k[:, :, 0]
        return cache[:, :, :8].float().sum()

    x, src, idx, _ = _operands("cpu")
    want_cache = x.clone()
    want = update(want_cache, idx, src)
    dev = [t.to("neuron") for t in (x, idx, src)]
    torch._dynamo.reset()
    compiled = torch.compile(update, backend="neuron")
    got = compiled(*dev)
    assert torch.equal(got.cpu(), want) and torch.equal(dev[0].cpu(), want_cache)
    # the graph is the in-place write the program made: no copy of the cache, no pass over it;
    # what eager charges for the same code
    x2 = dev[0].clone()
    rows = _charged(lambda: compiled(x2, dev[1], dev[2]))
    eager = _charged(lambda: update(x2, dev[1], dev[2]))
    full = [r for r in _charged(lambda: x2.mul_(1.0)) if r[0] == "mul"][0][2]
    assert all(r[2] < full for r in rows), rows
    assert sum(r[2] for r in rows) <= 1.01 * sum(r[2] for r in eager), (rows, eager)


@pytest.mark.parametrize("op", ["index_copy_", "slice"])
def test_a_cache_read_beside_its_update_is_not_written_in_place(op):
    """An input the graph reads elsewhere too keeps the functional op and its copy back: written
    in place, that read could see the new row."""
    def update(cache, pos, k):
        before = cache[:, :, 5].float().sum()  # read before the write: must see the old row
        if op == "index_copy_":
            cache.index_copy_(2, pos, k)
        else:
            cache[:, :, 5:6] = k
        return before, cache[:, :, 5].float().sum()

    x, src, idx, _ = _operands("cpu")
    want_cache = x.clone()
    want = update(want_cache, idx, src)
    dev = [t.to("neuron") for t in (x, idx, src)]
    torch._dynamo.reset()
    got = torch.compile(update, backend="neuron")(*dev)
    assert [torch.equal(g.cpu(), w) for g, w in zip(got, want)] == [True, True]
    assert torch.equal(dev[0].cpu(), want_cache)


def test_the_pass_rewrites_only_the_input_s_own_update():
    aten = torch.ops.aten
    graphs = []

    def backend(gm, inputs):
        def fw(g, _):
            graphs.append((reinplace_input_updates(g), [n.target for n in g.graph.nodes if n.op == "call_function"]))
            return g
        aot = _torch.compile_api("aot_module_simplified")
        return aot(gm, inputs, fw_compiler=fw, keep_inference_input_mutations=True)

    x, src, idx, _ = _operands("cpu")
    torch._dynamo.reset()
    torch.compile(_cache_update, backend=backend)(x, idx, src)
    (done, targets), = graphs
    assert done == 1 and aten.index_copy_.default in targets and aten.copy_.default not in targets
    assert aten.index_copy.default not in targets

"""The packed Linear: same outputs as F.linear outside autograd, never used for gradients or stale weights."""

import copy

import pytest
import torch
import torch.nn.functional as F

from codraft.models import linear
from codraft.models.linear import Linear, pack_linears, packed_dtype, packing_available, unpack_linears

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN linear")
needs_bf16 = pytest.mark.skipif(not linear.bf16_packing_available(),
                                reason="oneDNN has no bf16 linear on this CPU (the fallback is tested)")
FP32_KERNELS = ["native", "onednn"]  # fp32 copies run on codraft's own kernel where it builds, else on oneDNN's


@pytest.fixture
def onednn(monkeypatch):
    """fp32 and bf16 copies on oneDNN, as where codraft's kernels cannot run (cpu_kernels.py)."""
    monkeypatch.setattr(linear, "cpu_kernels", lambda: None)


@pytest.fixture(params=FP32_KERNELS)
def fp32_kernel(request, monkeypatch):
    if request.param == "onednn":
        monkeypatch.setattr(linear, "cpu_kernels", lambda: None)
    elif linear.cpu_kernels() is None:
        pytest.skip("codraft's fp32 kernel does not run here (no AVX-512, OpenMP or C++ compiler)")
    return request.param


@pytest.mark.parametrize("shape", [(1, 24), (5, 24), (3, 4, 24)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_forward_matches_f_linear(shape, bias, fp32_kernel):
    torch.manual_seed(0)
    layer = Linear(24, 40, bias=bias)
    x = torch.randn(shape)
    assert pack_linears(layer) == 1
    with torch.no_grad():
        out = layer(x)
    assert layer.packed is not None and layer.packed.native == (fp32_kernel == "native")
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_packed_rows_do_not_depend_on_how_many_share_the_call(fp32_kernel):
    torch.manual_seed(0)
    layer = Linear(64, 96, bias=False)
    pack_linears(layer)
    x = torch.randn(8, 64)
    with torch.no_grad():
        together = layer(x)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(8)])
    torch.testing.assert_close(together, alone, rtol=0, atol=0)


def test_gradients_never_use_the_packed_copy():
    torch.manual_seed(0)
    layer, reference = Linear(16, 8), torch.nn.Linear(16, 8)
    reference.load_state_dict(layer.state_dict())
    pack_linears(layer)
    x = torch.randn(4, 16, requires_grad=True)
    y = torch.randn(4, 16, requires_grad=True)
    layer(x).square().sum().backward()
    reference(y.detach().copy_(x.detach()).requires_grad_()).square().sum().backward()
    assert torch.equal(layer.weight.grad, reference.weight.grad)


def test_an_optimizer_step_makes_the_copy_stale_until_repacked():
    torch.manual_seed(0)
    layer = Linear(16, 8, bias=False)
    pack_linears(layer)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.5)
    layer(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight))  # the plain path, on the new weight
        pack_linears(layer)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


def test_unpack_drops_every_copy():
    module = torch.nn.Sequential(Linear(4, 4), torch.nn.ReLU(), Linear(4, 2))
    assert pack_linears(module) == 2
    unpack_linears(module)
    assert all(m.packed is None for m in module if isinstance(m, Linear))


def test_a_packed_module_deep_copies_without_its_packed_weights():
    """E.g. a frozen reference copy of the policy: it starts unpacked and packs on its own."""
    module = torch.nn.Sequential(Linear(4, 4), Linear(4, 2))
    pack_linears(module)
    clone = copy.deepcopy(module)
    assert all(m.packed is None for m in clone) and all(m.packed is not None for m in module)
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(clone(x), module(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(17, 64), (3, 25, 64), (300, 64), (1953, 64)])
def test_calls_padded_to_a_bucket_give_the_same_bits_and_shape(monkeypatch, shape, onednn):
    """Row counts above 8 run zero-padded to one of eight counts per doubling (oneDNN's copies)."""
    from codraft.models import linear

    torch.manual_seed(0)
    layer = Linear(64, 96, bias=True)
    pack_linears(layer)
    x = torch.randn(shape)
    with torch.no_grad():
        padded = layer(x)
        monkeypatch.setattr(linear, "run_rows", lambda rows: rows)
        plain = layer(x)
    assert padded.shape == plain.shape == (*shape[:-1], 96)
    torch.testing.assert_close(padded, plain, rtol=0, atol=0)


def test_row_counts_run_are_few_and_padding_is_bounded():
    from codraft.models.linear import run_rows

    assert len({run_rows(rows) for rows in range(1, 257)}) <= 48
    assert all(run_rows(rows) == rows for rows in range(1, 9))
    assert all(rows <= run_rows(rows) < rows * 9 / 8 for rows in range(9, 5000))


def test_after_the_first_pack_no_call_of_up_to_256_rows_builds_a_kernel(capfd, onednn):
    """oneDNN builds a kernel per row count met (about 0.5 MiB each): made at pack time, resident memory
    does not grow as a run meets new row counts."""
    layer = Linear(24, 40, bias=True)
    pack_linears(layer)
    capfd.readouterr()
    with torch.no_grad(), torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
        for rows in range(1, 257):
            layer(torch.randn(rows, 24))
    created = capfd.readouterr().out
    assert "create:cache_hit" in created and "create:cache_miss" not in created


def _group(bias: tuple[bool, ...] = (False, False, False)):
    from codraft.models.linear import FusedLinears

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.a, module.b, module.c = (Linear(24, n, bias=has) for n, has in zip((40, 8, 8), bias, strict=True))
    module.abc = FusedLinears(module.a, module.b, module.c)
    return module


@pytest.mark.parametrize("bias", [(False, False, False), (True, False, True)])
def test_a_packed_group_matches_each_member_s_f_linear(bias, fp32_kernel):
    module = _group(bias)
    assert pack_linears(module) == 1  # the group, not its members
    assert module.abc.packed is not None and all(m.packed is None for m in (module.a, module.b, module.c))
    x = torch.randn(3, 5, 24)
    with torch.no_grad():
        outs = module.abc(x)
    for out, m in zip(outs, (module.a, module.b, module.c), strict=True):
        torch.testing.assert_close(out, F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)


def test_a_group_runs_its_members_for_gradients_and_after_a_member_changed():
    module = _group()
    pack_linears(module)
    x = torch.randn(2, 24)
    outs = module.abc(x)  # autograd on: the members' own F.linear, bit for bit
    assert all(torch.equal(o, F.linear(x, m.weight)) for o, m in zip(outs, (module.a, module.b, module.c),
                                                                       strict=True))
    sum(o.sum() for o in outs).backward()
    assert module.b.weight.grad is not None
    with torch.no_grad():
        module.b.weight.add_(1.0)  # one member's in-place update makes the copy stale
        _, b_out, _ = module.abc(x)
        assert torch.equal(b_out, F.linear(x, module.b.weight))


def test_a_deep_copied_group_holds_the_copied_members_and_no_packed_weight():
    import copy

    module = _group()
    pack_linears(module)
    clone = copy.deepcopy(module)
    assert clone.abc.packed is None and clone.abc.linears[0] is clone.a and module.abc.packed is not None
    with torch.no_grad():
        clone.a.weight.zero_()
        assert torch.equal(clone.abc(torch.randn(1, 24))[0], torch.zeros(1, 40))


@needs_bf16
def test_bf16_copies_of_fp32_weights_hand_back_fp32_close_to_the_fp32_result():
    """A draft's inference matmuls may run on bf16 copies (half the bytes); its activations stay fp32."""
    module = _group((True, False, False))
    assert pack_linears(module, dtype=torch.bfloat16) == 1
    assert module.abc.packed.weight.dtype == torch.bfloat16
    x = torch.randn(4, 24)
    with torch.no_grad():
        out = module.abc(x)[0]
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, F.linear(x, module.a.weight, module.a.bias), rtol=2e-2, atol=2e-2)
        pack_linears(module)  # asking for the weights' own dtype repacks
        assert module.abc.packed.weight.dtype == torch.float32


@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("native", [True, False])
def test_auto_is_int8_or_bf16_for_a_draft_and_for_a_policy_bf16_only_where_shape_invariant(monkeypatch, native,
                                                                                          invariant, int8):
    """oneDNN runs bf16 on any AVX-512 core, by emulation where the CPU has no bf16 instructions: slower than
    fp32, so auto keeps the weights' dtype there. A policy's copies (`exact`) are bf16 only where bf16 rollouts are
    shape-invariant (AMX, or codraft's kernel): oneDNN's on AVX-512 BF16 without AMX made greedy speculation differ
    from plain decoding; never int8, whose rows depend on their call's other rows. A draft's are int8 wherever the
    quantized engine is there."""
    monkeypatch.setattr(linear, "native_bf16", lambda: native)
    monkeypatch.setattr(linear, "bf16_shape_invariant", lambda: invariant)
    monkeypatch.setattr(linear, "int8_packing_available", lambda: int8)
    bf16 = native and packing_available()
    assert packed_dtype("auto", torch.float32) == (torch.int8 if int8 and packing_available()
                                                   else torch.bfloat16 if bf16 else torch.float32)
    assert packed_dtype("auto", torch.float32, exact=True) == (torch.bfloat16 if bf16 and invariant else torch.float32)
    assert packed_dtype("float32", torch.float32) == torch.float32
    for exact in (False, True):
        assert packed_dtype("bfloat16", torch.float32, exact) == (torch.bfloat16 if linear.bf16_packing_available()
                                                                  else torch.float32)
    assert packed_dtype("int8", torch.float32) == (torch.int8 if int8 else torch.float32)
    with pytest.raises(ValueError, match="exact"):
        packed_dtype("int8", torch.float32, exact=True)


def test_without_a_bf16_linear_on_the_cpu_bf16_asked_for_runs_in_the_weights_dtype_with_one_logged_line(
        monkeypatch, caplog):
    """On an AVX2-only core oneDNN's bf16 reorder raises: inference_dtype=bfloat16 must cost speed, not a crash."""
    monkeypatch.setattr(linear, "bf16_packing_available", lambda: False)
    monkeypatch.setattr(linear, "_logged", set())
    module = torch.nn.ModuleDict({"body": Linear(24, 40), "head": Linear(40, 8)})
    with caplog.at_level("WARNING", logger=linear.__name__):
        assert packed_dtype("bfloat16", torch.float32) == torch.float32
        assert pack_linears(module, dtype=torch.bfloat16) == 2
        pack_linears(module, dtype=torch.bfloat16, force=True)
    assert all(m.packed.weight.dtype == torch.float32 for m in module.values())
    assert len([r for r in caplog.records if "no bf16 linear" in r.message]) == 1
    x = torch.randn(3, 24)
    with torch.no_grad():
        torch.testing.assert_close(module["body"](x), F.linear(x, module["body"].weight, module["body"].bias))


@pytest.mark.skipif(not linear.native_bf16(), reason="bf16 copies are used only where the CPU has bf16 arithmetic")
@pytest.mark.usefixtures("onednn")
def test_a_onednn_bf16_copy_gives_a_row_the_same_output_whatever_rows_share_its_call_up_to_a_rare_bf16_step():
    """oneDNN's bf16 kernels sum in another order above 32 rows (the Intel AMX host) and round the difference to a
    bf16 step in many outputs; the copy runs larger calls in slices of 32, so a verify forward's row is its decode
    step's but for outputs that round to the neighbouring bf16 value (none on the Intel host, ~1e-4 of them on an
    AMD AVX-512 BF16 one: module docstring). codraft's kernel has none (test_cpu_kernels.py)."""
    torch.manual_seed(0)
    layer = Linear(1536, 576, bias=False)  # SmolLM2's down projection
    pack_linears(layer, dtype=torch.bfloat16)
    x = torch.randn(100, 1536)
    with torch.no_grad():
        together = layer(x)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(100)])
        assert torch.equal(together[32:64], layer(x[32:64]))  # a call of 100 rows is its slices
    assert (together != alone).float().mean() < 1e-3
    step = alone.abs() * 2**-7 + 1e-5 * alone.abs().amax(-1, keepdim=True)  # a bf16 step; more where outputs cancel
    assert ((together - alone).abs() <= step).all()


@needs_bf16
def test_a_linear_marked_keep_dtype_is_packed_in_its_own_dtype_whatever_is_asked():
    module = torch.nn.ModuleDict({"body": Linear(24, 40), "head": Linear(40, 8)})
    module["head"].keep_dtype = True
    assert pack_linears(module, dtype=torch.bfloat16) == 2
    assert module["body"].packed.weight.dtype == torch.bfloat16
    assert module["head"].packed.weight.dtype == torch.float32


needs_int8 = pytest.mark.skipif(not linear.int8_packing_available(), reason="no x86/fbgemm quantized engine")


@needs_int8
@pytest.mark.parametrize("rows", [1, 4, 40])
def test_int8_copies_hand_back_fp32_close_to_the_fp32_result_and_never_serve_gradients(rows):
    """A draft's int8 copy (per-channel weights, per-call activations): within a few percent of the fp32 matmul's
    scale at the row counts a chain step, an absorb and a batch-32 proposal run; training never sees it."""
    module = _group((True, False, True))
    assert pack_linears(module, dtype=torch.int8) == 1
    assert module.abc.packed.dtype == torch.int8
    x = torch.randn(rows, 24)
    ref = torch.cat([F.linear(x, m.weight, m.bias) for m in (module.a, module.b, module.c)], -1)
    with torch.no_grad():
        out = torch.cat(module.abc(x), -1)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert (out - ref).abs().max() < 0.03 * ref.abs().max()
    with torch.enable_grad():
        assert torch.equal(torch.cat(module.abc(x), -1), ref)  # the members themselves, for gradients


@needs_int8
def test_a_raw_input_linear_is_packed_in_a_float_dtype_when_int8_is_asked():
    """Tap fusion reads the policy's residual stream, whose few huge dimensions would take a shared activation
    scale's whole range: it stays bf16 (or its own dtype) beside an int8 draft layer."""
    module = torch.nn.ModuleDict({"fc": Linear(24, 40), "body": Linear(40, 8)})
    module["fc"].raw_input = True
    assert pack_linears(module, dtype=torch.int8) == 2
    assert module["body"].packed.dtype == torch.int8
    assert module["fc"].packed.dtype == (torch.bfloat16 if linear.native_bf16() and linear.bf16_packing_available()
                                          else torch.float32)
    assert linear.packed_weight_bytes(module) == 40 * 8 + 40 * 24 * module["fc"].packed.dtype.itemsize + 40 * 4 + 8 * 4


@pytest.mark.parametrize("native", [True, False])
def test_training_autocast_auto_follows_native_bf16_whatever_the_draft_s_rollout_copies_are(monkeypatch, native):
    """`auto` draft copies are int8 where fbgemm is there; a draft's training matmuls are bf16 where the CPU has bf16
    arithmetic all the same (it read packed_dtype("auto") and lost bf16 when that became int8)."""
    from codraft.models import autocast

    monkeypatch.setattr(linear, "native_bf16", lambda: native)
    monkeypatch.setattr(linear, "int8_packing_available", lambda: True)
    layer = Linear(24, 40)
    assert autocast.training_autocast(layer, "auto")._enabled == (native and linear.bf16_packing_available())
    assert not autocast.training_autocast(layer, "float32")._enabled


def test_int8_asked_without_a_quantized_engine_runs_in_the_weights_dtype_with_one_logged_line(monkeypatch, caplog):
    monkeypatch.setattr(linear, "int8_packing_available", lambda: False)
    monkeypatch.setattr(linear, "_logged", set())
    layer = Linear(24, 40)
    with caplog.at_level("WARNING", logger=linear.__name__):
        pack_linears(layer, dtype=torch.int8)
        pack_linears(layer, dtype=torch.int8, force=True)
    assert layer.packed.dtype == torch.float32
    assert len([r for r in caplog.records if "no x86/fbgemm" in r.message]) == 1


def test_packed_kernels_names_what_each_copy_runs_on(fp32_kernel):
    module = torch.nn.ModuleDict({"a": Linear(24, 40), "b": Linear(24, 40)})
    assert linear.packed_kernels(module) == []
    pack_linears(module)
    assert linear.packed_kernels(module) == ["codraft_fp32" if fp32_kernel == "native" else "onednn_float32"]

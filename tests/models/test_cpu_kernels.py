"""codraft's CPU kernels (cpu_kernels.py): F.linear's (over fp32 or bf16 weights, fp32 or bf16 activations) and
F.rms_norm's outputs, a row's bits whatever rows share its call, and a fallback to oneDNN and torch with one logged line
wherever they cannot be built."""

import logging

import pytest
import torch
import torch.nn.functional as F

from codraft.models import cpu_kernels, linear
from codraft.models.linear import Linear, pack_linears
from codraft.models.model import RMSNorm


@pytest.fixture
def kernel():
    """Built at first use in the session's cache (tests/conftest.py), not at collection in the user's."""
    if cpu_kernels.cpu_kernels() is None:
        pytest.skip("codraft's kernels do not run here (no AVX-512, OpenMP or C++ compiler)")


def _run(x, weight, bias=None, pairs=None):
    return cpu_kernels.gemm(x, cpu_kernels.pack_panels(weight, pairs), bias, weight.shape[0])


@pytest.fixture(params=["fp32", "bf16_weights", "bf16"])
def layout(request):
    """fp32 weights; bf16 weights widened to fp32 (fp32 activations); bf16 pairs (activations rounded to bf16, AVX-512
    BF16 dot products): (weight dtype, pairs, the activations' dtype)."""
    if request.param == "bf16" and not cpu_kernels.bf16_dot_products():
        pytest.skip("this CPU has no AVX-512 BF16")
    return {"fp32": (torch.float32, False, torch.float32), "bf16_weights": (torch.bfloat16, False, torch.float32),
            "bf16": (torch.bfloat16, True, torch.bfloat16)}[request.param]


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("n", [1, 16, 17, 32, 33, 70])  # panels of 32 channels and their tails
@pytest.mark.parametrize("k", [1, 7, 64, 96])  # bf16 pairs need an even k: odd ones widen
@pytest.mark.parametrize("bias", [False, True])
def test_matches_a_float64_matmul(n, k, bias, layout):
    dtype, pairs, activations = layout
    torch.manual_seed(0)
    weight, x = torch.randn(n, k).to(dtype), torch.randn(25, k)  # 25 rows: two full tiles of 12 and a 1-row tail
    b = torch.randn(n) if bias else None
    rounded = x.to(activations) if k % 2 == 0 else x
    ref = F.linear(rounded.double(), weight.double(), None if b is None else b.double())
    out = _run(x, weight, b, pairs)
    assert out.shape == (25, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * k**0.5)


@pytest.mark.usefixtures("kernel")
def test_bf16_panels_are_half_the_bytes_and_only_float_weights_pack():
    weight = torch.randn(70, 24)
    for pairs in (False, True):
        assert cpu_kernels.pack_panels(weight.bfloat16(), pairs).nbytes * 2 == cpu_kernels.pack_panels(weight).nbytes
    with pytest.raises(TypeError, match="fp32 or bf16"):
        cpu_kernels.pack_panels(weight.half())


@pytest.mark.usefixtures("kernel")
def test_a_row_s_output_is_bitwise_the_same_whatever_rows_share_its_call(layout):
    """A decode step (1 row) and a verify forward (rows x (k+1)) must compute a token's matmuls alike: every
    output is one fma (or bf16 pair) chain over the inputs, whatever tile or thread runs it."""
    dtype, pairs, _ = layout
    torch.manual_seed(0)
    weight, bias = (torch.randn(200, 1536) * 0.05).to(dtype), torch.randn(200)  # SmolLM2's down projection's width
    panels = cpu_kernels.pack_panels(weight, pairs)
    x = torch.randn(37, 1536)
    alone = torch.cat([cpu_kernels.gemm(x[i : i + 1], panels, bias, 200) for i in range(37)])
    for rows in (2, 5, 12, 13, 25, 37):
        assert torch.equal(cpu_kernels.gemm(x[:rows], panels, bias, 200), alone[:rows]), rows
    assert torch.equal(cpu_kernels.gemm(x[3:9].view(2, 3, 1536), panels, bias, 200), alone[3:9].view(2, 3, 200))


@pytest.mark.usefixtures("kernel")
def test_an_empty_call_and_a_strided_input_run():
    weight = torch.randn(70, 24)
    assert _run(torch.randn(0, 24), weight).shape == (0, 70)
    x = torch.randn(24, 5).t()  # not contiguous
    torch.testing.assert_close(_run(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("kernel")
def test_packed_fp32_linears_run_on_it_bf16_ones_without_amx_and_int8_ones_not():
    module = torch.nn.ModuleDict({"a": Linear(24, 40), "b": Linear(24, 40), "c": Linear(24, 40)})
    pack_linears(module["a"])
    assert module["a"].packed.native and module["a"].packed.dtype == torch.float32
    pack_linears(module["b"], dtype=torch.bfloat16)
    if linear.bf16_packing_available():
        assert module["b"].packed.dtype == torch.bfloat16
        assert module["b"].packed.native != linear.amx()  # AMX: oneDNN's bf16
        assert module["b"].packed.bias.dtype == torch.float32 or not module["b"].packed.native
        x = torch.randn(3, 24)
        pairs = module["b"].packed.native and cpu_kernels.bf16_dot_products()  # activations rounded to bf16 too
        with torch.no_grad():
            torch.testing.assert_close(module["b"](x), F.linear(x.bfloat16().float() if pairs else x,
                                                                 module["b"].weight.bfloat16().float(),
                                                                 module["b"].bias), rtol=1e-5, atol=1e-5)
        kind = "codraft_bf16" if pairs else "codraft_bf16_weights" if module["b"].packed.native else "onednn_bfloat16"
        assert linear.packed_kernels(module["b"]) == [kind]
    if linear.int8_packing_available():
        pack_linears(module["c"], dtype=torch.int8)
        assert not module["c"].packed.native


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("d", [1, 17, 64, 576])
def test_rms_norm_matches_torch_s_and_a_row_s_bits_do_not_depend_on_its_call(d):
    torch.manual_seed(0)
    x, weight = torch.randn(40, d) * 3, torch.randn(d)
    out = cpu_kernels.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out, F.rms_norm(x, (d,), weight, 1e-5), rtol=1e-6, atol=1e-6)
    alone = torch.cat([cpu_kernels.rms_norm(x[i : i + 1], weight, 1e-5) for i in range(40)])
    assert torch.equal(out, alone)
    assert torch.equal(cpu_kernels.rms_norm(x.view(5, 8, d), weight, 1e-5), out.view(5, 8, d))


@pytest.mark.usefixtures("kernel")
def test_the_model_s_norm_runs_it_outside_autograd_only():
    norm = RMSNorm(64, 1e-6)
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(norm(x), cpu_kernels.rms_norm(x, norm.weight, 1e-6))
    assert torch.equal(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-6))  # training: torch's, for its gradients


@pytest.mark.parametrize("setup", ["switched_off", "no_compiler", "compile_fails"])
def test_where_they_cannot_be_built_matmuls_run_on_onednn_and_norms_on_torch_with_one_logged_line(
        monkeypatch, tmp_path, caplog, setup):
    monkeypatch.setenv("CODRAFT_CACHE", str(tmp_path))  # no build cached from earlier tests
    if setup == "switched_off":
        monkeypatch.setenv("CODRAFT_CPU_KERNELS", "0")
    elif setup == "no_compiler":
        monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    else:
        fake = tmp_path / "cxx"
        fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo fake && exit 0\necho 'error: broken' >&2; exit 1\n")
        fake.chmod(0o755)
        monkeypatch.setenv("CXX", str(fake))
    cpu_kernels.cpu_kernels.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=cpu_kernels.__name__):
            layer = Linear(24, 40)
            pack_linears(layer)
            pack_linears(Linear(24, 8))
        lines = [r for r in caplog.records if "run on oneDNN" in r.message]
        assert len(lines) == 1
        if setup == "compile_fails" and cpu_kernels._unsupported() is None:
            assert "broken" in lines[0].message and lines[0].levelno == logging.WARNING
        assert layer.packed is None or not layer.packed.native  # oneDNN's copy (none without oneDNN)
        x = torch.randn(3, 24)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
            norm = RMSNorm(24, 1e-6)
            assert torch.equal(norm(x), F.rms_norm(x, (24,), norm.weight, 1e-6))  # torch's norm
    finally:
        cpu_kernels.cpu_kernels.cache_clear()

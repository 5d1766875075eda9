"""What every benchmark's JSON says about the machine it ran on."""

import json

import torch

from codraft.bench.report import machine
from codraft.models.linear import bf16_packing_available, bf16_shape_invariant


def test_machine_names_the_cpu_its_vector_isa_and_whether_rollout_matmuls_can_run_bf16():
    info = json.loads(json.dumps(machine()))  # it goes into every results/*.json as it is
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert info["bf16_matmuls"] == bf16_packing_available()
    assert info["amx"] == torch.cpu._is_amx_tile_supported()
    assert info["bf16_shape_invariant"] == bf16_shape_invariant()
    assert isinstance(info["cpu"], str) and info["cpu_count"] >= 1

"""benchmarks/profile_step.py on CPU: the configuration grid, and the counts and tables of a profiled step."""

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import profile_step  # noqa: E402

from k3lit.model import ModelConfig  # noqa: E402

TINY = ModelConfig(vocab_size=64, dim=32, n_layers=4, layer_pattern="KA", n_heads=2, head_dim=16, mlp_hidden=48,
                   attnres_block_size=2)


def test_grid_is_every_combination():
    assert profile_step.grid(["residual=plain,block_attnres", "activation_checkpointing=none,block"]) == [
        {"residual": r, "activation_checkpointing": p} for r in ("plain", "block_attnres") for p in ("none", "block")]
    assert profile_step.grid([]) == [{}]


def test_profile_counts_ops_and_recomputation():
    """Block AttnRes dispatches more operators than the plain residual; under ``block`` the profile shows one
    reentrant recomputation per step for every segment but the last (8 sublayers in segments of 2: 3)."""
    plain = profile_step.profile_config(dataclasses.replace(TINY, residual="plain"), 1, 16, 1, 40, None)
    block = profile_step.profile_config(dataclasses.replace(TINY, activation_checkpointing="block"), 1, 16, 1, 40,
                                        None)
    assert 0 < plain["summary"]["ops"] < block["summary"]["ops"]
    assert plain["summary"]["sublayers"] == 8 and plain["summary"]["device_ms"] is None  # CPU: no kernels
    rows = [line.split() for line in block["full"].splitlines()]
    assert ["CheckpointFunctionBackward", "3.0"] in [r[:2] for r in rows]
    assert "CheckpointFunctionBackward" not in plain["full"]
    head = profile_step.headline(block["summary"], 1, 16)
    assert head.startswith("== block_attnres / block (S=2)") and "dispatched ops" in head


def _kernel_rows() -> dict[str, float]:
    """Kernel rows (no host time of their own) of the H200 profile of ``small`` stored in benchmarks/: name -> ms."""
    text = (Path(__file__).parents[2] / "benchmarks" / "profile_small_h200.txt").read_text()
    rows = {}
    for line in text.split("by self device time:")[1].splitlines()[2:]:
        *name, calls, cpu_ms, dev_ms = line.split()
        if float(cpu_ms) == 0 and not " ".join(name).startswith("Optimizer.step"):
            rows[" ".join(name)] = float(dev_ms)
    return rows


def test_every_kernel_of_a_profiled_h200_step_falls_in_its_group():
    rows = _kernel_rows()
    groups = {name: profile_step.kernel_group(name) for name in rows}
    expect = {"_main_bwd": "KDA", "_prep_fwd": "KDA", "_scan_fwd_t": "KDA", "_bwd_p": "short convolution",
              "_fwd": "short convolution", "_inter_bwd_sources": "AttnRes", "_merge_fwd": "AttnRes",
              "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "GEMM (projections, LM head)",
              "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_": "GEMM (projections, LM head)",
              "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_ker": "grouped GEMM (MoE experts)",
              "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f1": "softmax attention",
              "void at::native::(anonymous namespace)::cunn_SoftMaxBackwa": "cross-entropy",
              "void at::native::sbtopk::gatherTopK<float, unsigned int, 2": "routing: top-k and sort",
              "void at::native::(anonymous namespace)::multi_tensor_apply": "optimizer",
              "triton_poi_fused_short_conv_bwd_stack_view_38": "inductor's fused kernels (norms, gates, casts)",
              "void at::native::reduce_kernel<128, 4, at::native::ReduceO": profile_step.OTHER_KERNELS}
    assert {name: groups[name] for name in expect} == expect
    # kernels of an H100 profile of the same recipe (2026-12-07) that the file above predates
    later = {"_admit": "routing: top-k and sort",
             "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void const*, void*, void*, "
             "unsigned int, unsigned int)": "softmax attention",
             "void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, unsigned int)": "softmax attention"}
    assert {name: profile_step.kernel_group(name) for name in later} == later
    # the 12.7 ms of _main_bwd, 4.6 of _prep_fwd, 1.6 + 1.0 of the scans: KDA's kernels as RESULTS.md counts them
    kda = sum(ms for name, ms in rows.items() if groups[name] == "KDA")
    assert abs(kda - (12.73 + 4.57 + 1.58 + 1.03)) < 1e-6


def test_each_group_keeps_its_largest_kernels():
    """The stored summary names what each group's time is made of: its kernels by device time per step."""
    from types import SimpleNamespace as E

    kernels = [E(key="_main_bwd", self_device_time_total=2.4e4, count=18),
               E(key="_prep_fwd", self_device_time_total=9e3, count=18),
               E(key="void at::native::reduce_kernel<128, 4>", self_device_time_total=3e3, count=6)]
    kernels += [E(key=f"triton_poi_fused_{i}", self_device_time_total=100.0 * i, count=2) for i in range(1, 13)]
    top = profile_step._group_kernels(kernels, steps=2)
    assert top["KDA"] == [("_main_bwd", 12.0, 9.0), ("_prep_fwd", 4.5, 9.0)]
    assert top[profile_step.OTHER_KERNELS] == [("void at::native::reduce_kernel<128, 4>", 1.5, 3.0)]
    fused = top["inductor's fused kernels (norms, gates, casts)"]
    assert [name for name, _, _ in fused] == [f"triton_poi_fused_{i}" for i in range(12, 2, -1)]


def test_runs_side_by_side_by_kernel_group():
    a = {"kernel_groups": {"KDA": 20.0, "GEMM (projections, LM head)": 18.0}, "device_ms": 38.0, "kernels": 900,
         "wall_ms": 41.5}
    b = {"kernel_groups": {"GEMM (projections, LM head)": 16.0, "softmax attention": 4.0}, "device_ms": 20.0,
         "kernels": 400, "wall_ms": 22.3}
    lines = profile_step.side_by_side([("small", a), ("small_plain", b)]).splitlines()
    assert lines[0] == "| kernels | `small` ms | `small_plain` ms |"
    assert lines[2:] == ["| KDA | 20.00 | 0.00 |", "| GEMM (projections, LM head) | 18.00 | 16.00 |",
                         "| softmax attention | 0.00 | 4.00 |",
                         "| all device kernels (kernels a step) | 38.0 (900) | 20.0 (400) |",
                         "| step wall time | 41.5 | 22.3 |"]

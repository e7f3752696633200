"""The profile helpers of the GPU benchmarks, on constructed kernel lists."""

from scripts.device_profile import launch_details, step_parts


def test_step_parts_sums_kernels_by_kind():
    rows = [("paged_decode_k8v4_k4v2", 2.5, 32), ("policy_scores", 0.6, 32),
            ("gemm_fusion_dot_general_513", 0.25, 1), ("gemm_fusion_dot_394", 0.07, 2),
            ("input_scatter_fusion_383", 0.12, 32), ("input_scatter_fusion_379", 0.1, 64),
            ("loop_add_fusion_63", 0.22, 64), ("MemcpyD2H", 0.01, 1),
            ("decide_and_write", 0.15, 32), ("token_writes", 0.05, 32)]
    parts = step_parts(rows)
    assert parts == {"attention kernel": 2.5, "policy kernel": 0.6,
                     "matmuls": 0.25 + 0.07, "cache writes": 0.12 + 0.1 + 0.15 + 0.05,
                     "other": 0.22, "copies": 0.01}
    assert abs(sum(parts.values()) - sum(ms for _, ms, _ in rows)) < 1e-12


class _Event:
    def __init__(self, stats):
        self.stats = stats


def test_launch_details_reads_the_kernel_record():
    record = "regs:196 static_shared:0 dynamic_shared:15380 grid:2048,1,1 block:32,1,1 occ_pct:12.5"
    assert launch_details(_Event([("correlation_id", 7), ("kernel_details", record)])) == record
    assert launch_details(_Event([("correlation_id", 7)])) == ""
    assert launch_details(_Event(None)) == ""

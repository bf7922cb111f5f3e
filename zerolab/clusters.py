"""Cluster presets for the plan: per-GPU memory, rated compute, and the links of ``cost.py``.

Figures are vendors' published ratings (not measured here), per GPU and per direction:

- ``dgx-h100``: NVIDIA DGX H100, 8 x H100 SXM5 80 GB a node; NVLink 4 at 900 GB/s
  bidirectional (450 GB/s each way); 8 x ConnectX-7 400 Gb/s InfiniBand a node, one a GPU
  (50 GB/s); 989 TFLOPS dense BF16, 495 dense TF32 (the sparsity-doubled figures halved).
  Sources: the NVIDIA H100 Tensor Core GPU datasheet and the DGX H100 datasheet.
- ``dgx-h200``: NVIDIA DGX H200, the same node with 141 GB HBM3e a GPU and the same NVLink,
  network and compute ratings. Source: the NVIDIA H200 Tensor Core GPU datasheet.
- ``cloud-ethernet``: AWS p4d.24xlarge, 8 x A100 40 GB a node on NVSwitch (600 GB/s
  bidirectional, 300 each way), 400 Gb/s of EFA a node (6.25 GB/s a GPU); 312 TFLOPS dense
  BF16, 156 TF32. Sources: the AWS EC2 P4d instance page and the NVIDIA A100 datasheet.

Every field can be overridden from the command line (``--memory-gb``, ``--tflops``,
``--intra-gbs``, ``--inter-gbs``, ``--gpus-per-node``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from zerolab.cost import Cluster


@dataclass(frozen=True)
class Preset:
    cluster: Cluster  # links (cost.py)
    memory_bytes: float  # device memory per GPU
    tflops_bf16: float  # rated dense throughput per GPU, mixed precision
    tflops_fp32: float  # rated dense throughput per GPU, fp32 (TF32 tensor cores)
    source: str

    def tflops(self, mixed_precision: bool) -> float:
        return self.tflops_bf16 if mixed_precision else self.tflops_fp32


PRESETS = {
    "dgx-h100": Preset(Cluster("DGX H100: 8 x H100 80 GB a node, NVLink 450 GB/s, IB 50 GB/s a "
                               "GPU", ranks_per_node=8, intra_gbs=450, inter_gbs=50),
                       80e9, 989, 495, "NVIDIA H100 and DGX H100 datasheets"),
    "dgx-h200": Preset(Cluster("DGX H200: 8 x H200 141 GB a node, NVLink 450 GB/s, IB 50 GB/s a "
                               "GPU", ranks_per_node=8, intra_gbs=450, inter_gbs=50),
                       141e9, 989, 495, "NVIDIA H200 datasheet"),
    "cloud-ethernet": Preset(Cluster("AWS p4d.24xlarge: 8 x A100 40 GB a node, NVSwitch 300 GB/s, "
                                     "400 Gb/s EFA a node (6.25 GB/s a GPU)", ranks_per_node=8,
                                     intra_gbs=300, inter_gbs=6.25),
                             40e9, 312, 156, "AWS EC2 P4d page, NVIDIA A100 datasheet"),
}


def preset(name: str, memory_gb: float | None = None, tflops: float | None = None,
           intra_gbs: float | None = None, inter_gbs: float | None = None,
           gpus_per_node: int | None = None) -> Preset:
    """A preset with any of its figures replaced (None keeps the preset's)."""
    p = PRESETS[name]
    links = {k: v for k, v in dict(intra_gbs=intra_gbs, inter_gbs=inter_gbs,
                                   ranks_per_node=gpus_per_node).items() if v is not None}
    if links:
        p = replace(p, cluster=replace(p.cluster, name=p.cluster.name + " (overridden)", **links))
    if memory_gb is not None:
        p = replace(p, memory_bytes=memory_gb * 1e9)
    if tflops is not None:
        p = replace(p, tflops_bf16=tflops, tflops_fp32=tflops)
    return p

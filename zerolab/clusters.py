"""Cluster presets for the plan: the GPU (memory, compute, bandwidth) and the network of ``cost.py``.

Every figure is a vendor's rating, a published measurement, or NCCL's own tuning model, per GPU;
none was fitted to a published training run, and none to the runs the plan is checked against
(``benchmarks/plan_anchors.py``, ``benchmarks/plan_published.py``). Ratings are dense (no
sparsity).

**Compute as a GPU achieves it** (``zerolab/roofline.py``'s effects, each with its source):

- ``mamf``: the *maximum achievable matmul FLOPS* measured with bf16 inputs at the best shape,
  over the rated peak: S. Bekman, "Machine Learning Engineering", compute/accelerator/README.md,
  table "Maximum Achievable Matmul FLOPS comparison table": A100 SXM 271.2 of 312 (86.9%),
  H100 SXM 794.5 of 989 (80.3%; "H200 is the same"), B200 SXM 1745.0 of 2250 (77.6%), MI300X
  668.4 of 1300 (51.4%);
- ``waves``: cuBLAS's 256 x 128 output tiles, one an SM a wave (NVIDIA, "Matrix Multiplication
  Background User's Guide", docs.nvidia.com/deeplearning/performance/dl-performance-matrix-
  multiplication: tile and wave quantization); SMs from the datasheets: H100 SXM 132, A100
  108, B200 148, MI300X 304 compute units;
- ``attention``: FlashAttention-2, the kernel behind ``scaled_dot_product_attention``'s flash
  backend: 35% of an H100's peak (Shah et al., "FlashAttention-3", 2024, abstract), 50-73% of an
  A100's (Dao, "FlashAttention-2", 2023, abstract; the plan takes 50%, the backward, the larger
  part, being the slower). B200 and MI300X: no published figure used; the H100's is assumed;
- ``kernel`` (``--attention-kernel``): the attention kernel a run used, where it is not
  FlashAttention-2. ``triton``, FlashAttention in Triton (the kernel behind MPT's
  ``attn_impl: triton``, llm-foundry's default in 2023, run on the pre-MLIR Triton compiler):
  FlashAttention-2 is 1.3-1.5x faster forward and about 2x faster backward (Dao,
  "FlashAttention-2", 2023, section 4.1), so 1/1.4 and 1/2 of FlashAttention-2's rate;
- ``hbm``: a coalesced streaming read on an H100 SXM measured 2.8 of the rated 3.35 TB/s, 84%
  (mikamirai.com/blog/gpu-memory-bandwidth, Nsight Compute, 2026); the same share is assumed
  for every GPU;
- ``launch``: a kernel launch costs 4-6 us of driver and runtime calls (susun-blog.com,
  "pegainfer (3): From Launch Overhead to CUDA Graph"); eager mode launches every operator, so
  none takes less than 4 us here;
- ``power``: only where the source of a preset says its GPUs ran under a power limit
  (``h100-96gb``, below);
- ``contention``: computation overlapped with communication ran 18.9% slower on average (40%
  at worst) than alone, on H100s and A100s training GPT and Llama models (Lee et al.,
  "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning",
  arXiv 2507.03114, abstract): compute is slowed by 18.9% while a collective is in flight.

**The network as NCCL runs it** (``zerolab/cost.py``: NCCL's tuning model and constants):
``intra_gbs`` is the ring bus bandwidth NCCL reaches within a node, ``inter_gbs`` one NIC's
line rate, ``nics_per_node`` the NICs a node's channels spread over, ``net_efficiency`` the
share of a NIC's line rate a collective reaches: 0.92, NCCL's own (its LL128 protocol's 120 of
128 bytes, ``busBw * 0.92``; nccl-tests across nodes report bus bandwidths about this close to
the NICs' sum). Within a node: A100, 235 GB/s, NCCL's ceiling for compute capability 8.0
(``tuning.cc``: ``if (compCap80) busBw = std::min(busBw, 235.0f)``), inside the 230-250 GB/s
nccl-tests measures on 8 A100s (docs.alayanew.com, "NCCL-tests in practice", reference table);
that is 78% of NVLink 3's 300 GB/s each way, and the other presets take the same 78% of their
own NVLink (H100: 352 of 450 GB/s; nccl-tests' 460-480 GB/s on 8 H100s is an all-reduce
through NVLink SHARP, which the model leaves out).

The presets:

- ``dgx-h100``: NVIDIA DGX H100, 8 x H100 SXM5 80 GB HBM3 (3.35 TB/s) a node; NVLink 4, 900 GB/s
  bidirectional (450 each way); 8 x ConnectX-7 400 Gb/s a node, one a GPU (50 GB/s); 989
  TFLOPS dense BF16, 495 TF32. Sources: NVIDIA H100 Tensor Core GPU and DGX H100 datasheets.
- ``h100-96gb``: the GPUs of torchtitan's published Llama 3.1 runs (its
  ``benchmarks/llama3_h100_202412_torchtitan.md``): Meta's Grand Teton, 8 x H100 96 GB HBM2e at
  2.4 TB/s a node, NVLink between all 8, 400 Gb/s of RDMA a GPU, a 500 W power limit (700 W is
  the SXM rating). torchtitan: its peak is "between SXM and NVL" (989 and 835 TFLOPS). The
  ``power`` effect takes the peak on the line between the two ratings at their power limits
  (NVL 400 W, SXM 700 W; NVIDIA H100 datasheet): 835 + (989 - 835) x 100 / 300 = 886 TFLOPS at
  500 W. MFU is still counted against 989, as torchtitan counts it.
- ``dgx-h200``: NVIDIA DGX H200: 8 x H200 141 GB HBM3e (4.8 TB/s), otherwise the DGX H100's
  links and compute. Source: NVIDIA H200 Tensor Core GPU datasheet.
- ``dgx-a100-40gb`` / ``dgx-a100-80gb``: NVIDIA DGX A100: 8 x A100 SXM4 40 GB HBM2 (1.555 TB/s)
  or 80 GB HBM2e (2.039 TB/s); NVLink 3, 600 GB/s bidirectional (300 each way); 8 x ConnectX-6
  200 Gb/s HDR a node (25 GB/s a GPU); 312 TFLOPS BF16, 156 TF32. Sources: NVIDIA A100 Tensor
  Core GPU and DGX A100 datasheets.
- ``cloud-ethernet``: AWS p4d.24xlarge: the A100 40 GB of above on NVSwitch, but 400 Gb/s of
  EFA a node (4 x 100 Gb/s). Source: the AWS EC2 P4d instance page.
- ``dgx-b200``: NVIDIA DGX B200: 8 x B200 180 GB HBM3e (8 TB/s); NVLink 5, 1.8 TB/s
  bidirectional (900 each way); 8 x ConnectX-7 400 Gb/s (50 GB/s a GPU); 2,250 TFLOPS dense
  BF16, 1,125 TF32. Sources: NVIDIA DGX B200 datasheet, NVIDIA Blackwell datasheet (HGX B200).
- ``mi300x``: AMD Instinct MI300X platform: 8 x MI300X 192 GB HBM3 (5.3 TB/s) a node, fully
  connected by Infinity Fabric, 896 GB/s aggregate bidirectional a GPU (448 each way); one
  400 Gb/s NIC a GPU (50 GB/s, as Azure's ND MI300X v5); 1,307 TFLOPS dense BF16, 654 TF32.
  NCCL's figures stand in for RCCL's. Sources: AMD Instinct MI300X datasheet and platform
  brief, Azure ND MI300X v5 page.

Every field can be overridden from the command line (``--memory-gb``, ``--tflops``,
``--intra-gbs``, ``--inter-gbs``, ``--gpus-per-node``), and ``--efficiency`` scales every
achievable rate to your own measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from zerolab.cost import Cluster
from zerolab.roofline import Device

# Measured fractions of the rated peak (see the module docstring for each source)
MAMF = {"A100": 271.2 / 312, "H100": 794.5 / 989, "B200": 1745.0 / 2250, "MI300X": 668.4 / 1300}
FLASH2 = {"A100": 0.50, "H100": 0.35}
SMS = {"A100": 108, "H100": 132, "B200": 148, "MI300X": 304}
HBM = 2.8 / 3.35  # a streaming read's bandwidth / rated, H100 SXM
LAUNCH_US = 4.0  # the low end of a kernel launch's 4-6 us
CONTENTION = 0.189  # compute's mean slowdown beside a collective
NVLINK_RING = 235 / 300  # NCCL's A100 ring bus bandwidth / NVLink 3's line rate, each way
NET_EFFICIENCY = 0.92  # NCCL's busBw * 0.92


@dataclass(frozen=True)
class Preset:
    cluster: Cluster  # links (cost.py)
    device: Device  # compute and memory bandwidth (roofline.py)
    memory_bytes: float  # device memory per GPU
    source: str

    def tflops(self, mixed_precision: bool) -> float:
        """The rated dense throughput (TF32 for fp32)."""
        return self.device.tflops_bf16 if mixed_precision else self.device.tflops_fp32


def _gpu(name, family, bf16, tf32, tbs, attention_as=None, clock_factor=1.0):
    return Device(name, bf16, tf32, tbs, MAMF[family], FLASH2[attention_as or family],
                  sms=SMS[family], memory_efficiency=HBM, launch_us=LAUNCH_US,
                  clock_factor=clock_factor, comm_slowdown=CONTENTION)


def _net(name, nvlink_gbs, nic_gbs, nics=8):
    """Eight GPUs a node on NVLink (line rate each way), ``nics`` NICs of ``nic_gbs``."""
    return Cluster(name, ranks_per_node=8, intra_gbs=round(nvlink_gbs * NVLINK_RING, 1),
                   inter_gbs=nic_gbs, nics_per_node=nics, net_efficiency=NET_EFFICIENCY)


_H100 = _gpu("H100 SXM5 80 GB", "H100", 989, 495, 3.35)
_A100_40 = _gpu("A100 SXM4 40 GB", "A100", 312, 156, 1.555)
# torchtitan's GPUs at 500 W: on the line from the NVL's 835 TFLOPS at 400 W to the SXM's 989
# at 700 W
_POWER_500W = (835 + (989 - 835) * (500 - 400) / (700 - 400)) / 989

PRESETS = {
    "dgx-h100": Preset(_net("DGX H100: 8 x H100 80 GB a node, NVLink 450 GB/s, 8 x 400 Gb/s IB",
                            450, 50), _H100, 80e9, "NVIDIA H100 and DGX H100 datasheets"),
    "h100-96gb": Preset(_net("Grand Teton (torchtitan's runs): 8 x H100 96 GB HBM2e a node at "
                             "500 W, NVLink 450 GB/s, 8 x 400 Gb/s RDMA", 450, 50),
                        _gpu("H100 96 GB HBM2e, 500 W", "H100", 989, 495, 2.4,
                             clock_factor=_POWER_500W), 96e9,
                        "torchtitan benchmarks/llama3_h100_202412_torchtitan.md; NVIDIA H100 "
                        "datasheet"),
    "dgx-h200": Preset(_net("DGX H200: 8 x H200 141 GB a node, NVLink 450 GB/s, 8 x 400 Gb/s IB",
                            450, 50),
                       _gpu("H200 141 GB", "H100", 989, 495, 4.8), 141e9,
                       "NVIDIA H200 datasheet"),
    "dgx-a100-40gb": Preset(_net("DGX A100: 8 x A100 40 GB a node, NVLink 300 GB/s, 8 x 200 Gb/s "
                                 "IB", 300, 25), _A100_40, 40e9,
                            "NVIDIA A100 and DGX A100 datasheets"),
    "dgx-a100-80gb": Preset(_net("DGX A100: 8 x A100 80 GB a node, NVLink 300 GB/s, 8 x 200 Gb/s "
                                 "IB", 300, 25),
                            _gpu("A100 SXM4 80 GB", "A100", 312, 156, 2.039), 80e9,
                            "NVIDIA A100 and DGX A100 datasheets"),
    "cloud-ethernet": Preset(_net("AWS p4d.24xlarge: 8 x A100 40 GB a node, NVSwitch 300 GB/s, "
                                  "4 x 100 Gb/s EFA a node", 300, 12.5, nics=4),
                             _A100_40, 40e9, "AWS EC2 P4d page, NVIDIA A100 datasheet"),
    "dgx-b200": Preset(_net("DGX B200: 8 x B200 180 GB a node, NVLink 900 GB/s, 8 x 400 Gb/s IB",
                            900, 50),
                       _gpu("B200 180 GB", "B200", 2250, 1125, 8.0, attention_as="H100"), 180e9,
                       "NVIDIA DGX B200 and Blackwell datasheets"),
    "mi300x": Preset(_net("8 x MI300X 192 GB a node, Infinity Fabric 448 GB/s, 8 x 400 Gb/s "
                          "across", 448, 50),
                     _gpu("MI300X 192 GB", "MI300X", 1307, 654, 5.3, attention_as="H100"), 192e9,
                     "AMD Instinct MI300X datasheet, Azure ND MI300X v5"),
}


def preset(name: str, memory_gb: float | None = None, tflops: float | None = None,
           intra_gbs: float | None = None, inter_gbs: float | None = None,
           gpus_per_node: int | None = None, attention: str | None = None) -> Preset:
    """A preset with any of its figures replaced (None keeps the preset's); ``attention``
    names the attention kernel the run used (``roofline.ATTENTION_KERNELS``)."""
    p = PRESETS[name]
    if attention is not None:
        p = replace(p, device=replace(p.device, attention_kernel=attention))
    links = {k: v for k, v in dict(intra_gbs=intra_gbs, inter_gbs=inter_gbs,
                                   ranks_per_node=gpus_per_node).items() if v is not None}
    if links:
        p = replace(p, cluster=replace(p.cluster, name=p.cluster.name + " (overridden)", **links))
    if memory_gb is not None:
        p = replace(p, memory_bytes=memory_gb * 1e9)
    if tflops is not None:
        # (the peak the GPUs run at, given: no power limit on top of it)
        p = replace(p, device=replace(p.device, tflops_bf16=tflops, tflops_fp32=tflops,
                                      clock_factor=1.0))
    return p

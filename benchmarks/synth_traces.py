"""Synthetic Kineto traces of a given size: the inputs of ``bench_traces.py --sizes/--ranks``.

One rank is ``ProfilerStep`` after ``ProfilerStep`` of a transformer-like training step, in the
event mix a CUDA ``torch.profiler`` run writes with ``record_shapes=True`` (about 330 bytes of
JSON per event, as in the real A100 job of the test data):

* per layer, forward on the main thread: ``aten::linear`` -> ``aten::t`` -> ``aten::transpose`` ->
  ``aten::as_strided`` and ``aten::addmm`` (shapes recorded), its ``cudaLaunchKernel`` with the
  flow events (``ph`` ``s``/``f``) Kineto draws, a GEMM kernel; ``aten::gelu`` and its kernel;
* per layer, backward on autograd's thread: ``aten::mm`` twice (two GEMM kernels);
* per step: the ranges ``## forward ##`` / ``## backward ##`` / ``## optimizer ##``, one
  ``Memcpy HtoD``, one NCCL all-reduce (``record_param_comms`` with its sizes, the kernel on its
  own stream) and a fused optimizer kernel.

The GPU runs each kernel after its launch and after the previous kernel on its stream, so it lags
the host a little.  :func:`write_rank` returns what it wrote (events, kernels, their summed
time, steps), the answer a reader must find.  Written gzipped (level 1: generation speed; the
decompression speed does not depend on the level).
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

T0 = 1_700_000_000_000_000  # us: an absolute epoch time, as Kineto writes
LAYERS = 96  # per step


@dataclass
class Written:
    path: str
    json_bytes: int
    events: int
    kernels: int  # kernels, memcpys and memsets
    kernel_us: float  # their summed duration
    steps: int
    rank: int

    def as_dict(self) -> dict:
        return asdict(self)


class _Rank:
    def __init__(self, rank: int, world: int, seed: int):
        self.rng = random.Random(seed)
        self.rank, self.world = rank, world
        self.ext = 1_000_001  # ids as a long-running process has them (HTA sizes its columns by their range)
        self.corr = 1_000_001
        self.t = 0.0  # host clock, us after T0
        self.gpu_free = {7: 0.0, 20: 0.0}
        self.kernels = 0
        self.kernel_us = 0.0
        self.events = 0
        self.main, self.bwd = 1000 + rank, 2000 + rank

    def ts(self, t: float) -> str:
        return f"{T0 + int(t)}.{int(round((t % 1) * 1000)) % 1000:03d}"

    def x(self, cat: str, name: str, t: float, dur: float, tid: int, args: str, pid: int | None = None) -> str:
        self.events += 1
        pid = 1000 + self.rank if pid is None else pid
        return (
            f'{{"ph": "X", "cat": "{cat}", "name": "{name}", "pid": {pid}, "tid": {tid}, '
            f'"ts": {self.ts(t)}, "dur": {dur:.3f}, "args": {{{args}}}}}'
        )

    def op(self, name: str, t: float, dur: float, tid: int, dims: str = "", types: str = "") -> tuple[str, int]:
        e = self.ext
        self.ext += 1
        shapes = f', "Input Dims": {dims}, "Input type": {types}' if dims else ""
        args = f'"External id": {e}, "Record function id": 0, "Ev Idx": {e - 1}{shapes}'
        return self.x("cpu_op", name, t, dur, tid, args), e

    def launch(
        self, name: str, t: float, tid: int, ext: int, dur: float, stream: int = 7, extra: str = "", cat: str = "kernel"
    ) -> list[str]:
        """cudaLaunchKernel at ``t`` on ``tid`` and its activity ``name`` (``cat``) of ``dur`` us on ``stream``."""
        c = self.corr
        self.corr += 1
        start = max(t + 4.0, self.gpu_free[stream])
        self.gpu_free[stream] = start + dur + 0.5
        self.kernels += 1
        self.kernel_us += float(f"{dur:.3f}")
        pid = 1000 + self.rank
        self.events += 2
        k_args = f'"External id": {ext}, "device": 0, "context": 1, "stream": {stream}, "correlation": {c}'
        if cat == "kernel":
            k_args += (
                ', "queued": 0, "registers per thread": 128, "shared memory": 49152, "blocks per SM": 1.2, '
                '"warps per SM": 4.8, "grid": [132, 1, 1], "block": [256, 1, 1], "est. achieved occupancy %": 12'
            )
        k_args += extra
        return [
            self.x(
                "cuda_runtime",
                "cudaLaunchKernel",
                t,
                3.5,
                tid,
                f'"External id": {ext}, "cbid": 211, "correlation": {c}',
            ),
            f'{{"ph": "s", "id": {c}, "pid": {pid}, "tid": {tid}, "ts": {self.ts(t)}, "cat": "ac2g", "name": "ac2g"}}',
            f'{{"ph": "f", "id": {c}, "pid": 0, "tid": {stream}, "ts": {self.ts(start)}, "cat": "ac2g", '
            f'"name": "ac2g", "bp": "e"}}',
            self.x(cat, name, start, dur, stream, k_args, pid=0),
        ]

    def step(self, n: int) -> list[str]:
        ev: list[str] = []
        rng = self.rng
        t_step = self.t
        body: list[str] = []
        t = t_step + 5
        fwd_start = t
        for layer in range(LAYERS):
            b, k, m = 4096, 3072, 3072 * (1 + layer % 4)
            lin, e_lin = self.op("aten::linear", t, 40, self.main, f"[[{b}, {k}], [{m}, {k}], [{m}]]",
                                 '["c10::BFloat16", "c10::BFloat16", "c10::BFloat16"]')  # fmt: skip
            body.append(lin)
            body.append(self.op("aten::t", t + 1, 6, self.main, f"[[{m}, {k}]]", '["c10::BFloat16"]')[0])
            body.append(self.op("aten::transpose", t + 2, 4, self.main, f"[[{m}, {k}], [], []]",
                                '["c10::BFloat16", "Scalar", "Scalar"]')[0])  # fmt: skip
            body.append(self.op("aten::as_strided", t + 3, 2, self.main, f"[[{m}, {k}], [], [], []]",
                                '["c10::BFloat16", "", "", ""]')[0])  # fmt: skip
            mm, e_mm = self.op("aten::addmm", t + 10, 28, self.main, f"[[{m}], [{b}, {k}], [{k}, {m}], [], []]",
                               '["c10::BFloat16", "c10::BFloat16", "c10::BFloat16", "Scalar", "Scalar"]')  # fmt: skip
            body.append(mm)
            gemm = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_cluster"
            body += self.launch(gemm, t + 30, self.main, e_mm, rng.uniform(40, 220))
            t += 45
            gl, e_g = self.op("aten::gelu", t, 14, self.main, f"[[{b}, {m}], []]", '["c10::BFloat16", ""]')
            body.append(gl)
            ew = "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl, Array<char*, 2> >"
            body += self.launch(ew, t + 6, self.main, e_g, rng.uniform(4, 30))
            t += 20
        fwd = f'"External id": {self.ext}'
        self.ext += 1
        ev.append(self.x("user_annotation", "## forward ##", fwd_start - 1, t - fwd_start + 2, self.main, fwd))
        bwd_start = t
        for _layer in range(LAYERS):
            for _ in range(2):
                mm, e_mm = self.op("aten::mm", t, 25, self.bwd, "[[4096, 3072], [3072, 3072]]",
                                   '["c10::BFloat16", "c10::BFloat16"]')  # fmt: skip
                body.append(mm)
                body += self.launch("sm90_xmma_gemm_bf16bf16_bf16f32_f32_nn_n_tilesize128x128x64", t + 12, self.bwd,
                                    e_mm, rng.uniform(40, 200))  # fmt: skip
                t += 30
        ev.append(self.x("user_annotation", "## backward ##", bwd_start - 1, t - bwd_start + 2, self.main,
                         f'"External id": {self.ext}'))  # fmt: skip
        self.ext += 1
        nelems = 25_165_824
        comm_args = (f'"In msg nelems": {nelems}, "Out msg nelems": {nelems}, "dtype": "BFloat16", "Group size": '
                     f'{self.world}, "Process Group Name": "0", "Collective name": "allreduce"')  # fmt: skip
        e = self.ext
        self.ext += 1
        body.append(self.x("cpu_op", "record_param_comms", t, 30, self.bwd, f'"External id": {e}, {comm_args}'))
        nccl = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
        body += self.launch(nccl, t + 5, self.bwd, e, rng.uniform(800, 1200), stream=20, extra=", " + comm_args)
        t += 40
        opt_start = t
        o, e_o = self.op("aten::_fused_adamw_", t, 60, self.main)
        body.append(o)
        body += self.launch("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", t + 20, self.main, e_o,
                            rng.uniform(300, 500))  # fmt: skip
        c, e_c = self.op("aten::copy_", t + 70, 20, self.main, "[[4096, 3072], [4096, 3072], []]",
                         '["c10::BFloat16", "c10::BFloat16", "Scalar"]')  # fmt: skip
        body.append(c)
        body += self.launch("Memcpy HtoD (Pinned -> Device)", t + 75, self.main, e_c, 20.0, cat="gpu_memcpy",
                            extra=', "bytes": 25165824, "memory bandwidth (GB/s)": 1258.3')  # fmt: skip
        t += 100
        ev.append(self.x("user_annotation", "## optimizer ##", opt_start - 1, t - opt_start + 2, self.main,
                         f'"External id": {self.ext}'))  # fmt: skip
        self.ext += 1
        end = max(t, self.gpu_free[7], self.gpu_free[20]) + 10
        ev.insert(0, self.x("user_annotation", f"ProfilerStep#{n}", t_step, end - t_step, self.main,
                            f'"External id": {self.ext}'))  # fmt: skip
        self.ext += 1
        self.t = end + 1
        return ev + body


def write_rank(path: str | Path, target_mb: float, *, rank: int = 0, world: int = 1, seed: int = 0) -> Written:
    """One rank of about ``target_mb`` MB of JSON (whole steps; at least two), gzipped when the name
    ends in ``.gz``; returns what was written (see the module note)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    r = _Rank(rank, world, seed)
    props = [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85045149696, "computeMajor": 9,
              "computeMinor": 0, "numSms": 132}]  # fmt: skip
    head = (
        '{"schemaVersion": 1, "deviceProperties": ' + json.dumps(props) + ', "distributedInfo": '
        + json.dumps({"backend": "nccl", "rank": rank, "world_size": world}) + ', "record_shapes": 1, '
        '"traceEvents": [\n'
    )  # fmt: skip
    tail = '\n], "traceName": "made by benchmarks/synth_traces.py"}\n'
    target = int(target_mb * 1e6)
    tmp = path.with_name(path.name + ".part")
    opener = (lambda p: gzip.open(p, "wt", compresslevel=1)) if path.name.endswith(".gz") else (lambda p: open(p, "w"))
    written, steps = len(head) + len(tail), 0
    with opener(tmp) as fh:
        fh.write(head)
        first = True
        while steps < 2 or written < target:
            text = ",\n".join(r.step(1000 + steps))
            fh.write(text if first else ",\n" + text)
            written += len(text) + (0 if first else 2)
            first = False
            steps += 1
        fh.write(tail)
    tmp.replace(path)  # a rank cut short by Ctrl-C is never left under its final name
    return Written(str(path), written, r.events, r.kernels, r.kernel_us, steps, rank)


def write_job(folder: str | Path, ranks: int, rank_mb: float, *, seed: int = 0) -> list[Written]:
    """``ranks`` files ``rank-<r>.json.gz`` of ``rank_mb`` MB each in ``folder`` (one job)."""
    folder = Path(folder)
    return [write_rank(folder / f"rank-{r}.json.gz", rank_mb, rank=r, world=ranks, seed=seed + r) for r in range(ranks)]

"""What a Triton kernel's tile costs in registers and stack on an NVIDIA GPU, found with no GPU: each kernel compiled
for the target (``triton.compile`` on a ``GPUTarget``: Triton's own LLVM and ptxas, from the wheel) and ptxas's
report on its PTX (registers a thread, stack frame, spill stores and loads). A tile whose state does not fit the
registers spills to local memory; whether that costs time is the GPU's to say (bench/gdn_decode.py times the tiles),
but a CPU machine can rule tiles in or out before a GPU session.

    python bench/kernel_resources.py                      # Qwen3.5's GDN decode step and verify, every tile, sm_90a
    python bench/kernel_resources.py --tiles 64x4 --arch 100
    python bench/kernel_resources.py --kernels adamw8bit  # the 8-bit AdamW kernel's tiles (absmax blocks x warps)

The report is of the Triton and ptxas that run it: the GPU machine's own (stage ``kernel-resources``) may differ
from a CPU machine's. Kernels (``gdn_decode.TILED_KERNELS``): ``gdn_step``, the decode step, ``gdn_verify``, the
verify of 3 tokens (as the engine runs it: no state written), and ``gdn_replay``, its commit, at the 9B shape's
head dims (128), fp32 and bf16 state pools, one row per (kernel, state dtype, tile). Rows go to
bench/results/kernel_resources.jsonl (the Triton version and target in each).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import append_jsonl, env_info, print_table, tiles  # noqa: E402

from areno.kernels import adamw8bit  # noqa: E402
from areno.kernels.linear_attn import gdn_decode  # noqa: E402

_STEP = ("QKV:*bf16 stride_x:i32 A:*bf16 B_:*bf16 stride_ab:i32 A_LOG:*fp32 DT_BIAS:*fp32 STATE:*S IDX:*i32 O:*bf16 "
         "scale:fp32 eps:fp32 H:i32 REP:i32 KD:i32 K:i32 V:i32")
_VERIFY = ("QKV:*bf16 stride_x:i32 A:*bf16 B_:*bf16 stride_ab:i32 A_LOG:*fp32 DT_BIAS:*fp32 STATE:*S IDX:*i32 "
           "O:*bf16 scale:fp32 eps:fp32 H:i32 REP:i32 KD:i32 K:i32 V:i32")
_REPLAY = ("QKV:*bf16 stride_x:i32 A:*bf16 B_:*bf16 stride_ab:i32 A_LOG:*fp32 DT_BIAS:*fp32 STATE:*S IDX:*i32 "
           "CNT:*i32 eps:fp32 H:i32 REP:i32 KD:i32 K:i32 V:i32")
_ADAMW8BIT = ("W:*fp32 G:*bf16 MQ:*u8 VQ:*u8 MA:*fp32 VA:*fp32 SMAP:*fp32 UMAP:*fp32 n:i64 LR:*fp32 STEP_SIZE:*fp32 "
              "BC2_SQRT:*fp32 SCALE:*fp32 SKIP:*fp32 beta1:fp32 beta2:fp32 eps:fp32 weight_decay:fp32")
# name: (jit function, runtime signature (S: the state pool's type), the tile's first number's name, constexprs
# given it, default tiles)
KERNELS = {
    "gdn_step": (gdn_decode.TILED_KERNELS["gdn_step"], _STEP, "BV", lambda bv: {"HAS_IDX": True, "BK": 128, "BV": bv},
                 "128x4,128x8,64x2,64x4,32x2,32x4,16x2"),
    "gdn_verify": (gdn_decode.TILED_KERNELS["gdn_verify"], _VERIFY, "BV",  # as the engine runs it: nothing written
                   lambda bv: {"N": 3, "WRITE": False, "BK": 128, "BV": bv},
                   "128x4,128x8,64x2,64x4,32x2,32x4,16x2"),
    "gdn_replay": (gdn_decode.TILED_KERNELS["gdn_replay"], _REPLAY, "BV", lambda bv: {"N": 3, "BK": 128, "BV": bv},
                   "128x4,128x8,64x2,64x4,32x2,32x4,16x2"),
    "adamw8bit": (adamw8bit.adamw8bit_kernel, _ADAMW8BIT, "rows",
                  lambda rows: {"HAS_GRAD": True, "BLOCK": adamw8bit.QBLOCK, "ROWS": rows},
                  "8x8,4x16,4x8,2x8,2x4,1x4,1x2,1x1"),
}
STATE_TYPES = {"float32": "fp32", "bfloat16": "bf16"}


def resident_warps(registers: int, warps: int) -> int:
    """Warps an SM keeps resident for a program of ``warps`` warps at ``registers`` a thread, by the register file
    alone (65,536 a multiprocessor, a warp's allocated in units of 256; at most 64 warps and 32 programs)."""
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    return min(65536 // (per_warp * warps), 32, 64 // warps) * warps


def ptxas_path(capability: int) -> str:
    """The ptxas Triton itself runs for ``capability`` (``TRITON_PTXAS_PATH`` honoured; ptxas-blackwell from sm_100
    on), or, on a Triton without ``get_ptxas``, the wheel's own by the same rule."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(capability).path
    except (ImportError, AttributeError, TypeError):
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        return ptxas + "-blackwell" if capability >= 100 and os.path.exists(ptxas + "-blackwell") else ptxas


def ptxas_report(ptx: str, arch: str) -> dict:
    """ptxas -v on ``ptx`` for ``arch`` (e.g. "sm_90a"): registers, stack bytes, spill store / load bytes."""
    ptxas = ptxas_path(int(re.sub(r"\D", "", arch)))
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-v", "--gpu-name", arch, src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, check=True)  # fmt: skip
    text = out.stdout + out.stderr
    num = lambda pattern: int(m.group(1)) if (m := re.search(pattern, text)) else 0  # noqa: E731
    return {"registers": num(r"Used (\d+) registers"), "stack_bytes": num(r"(\d+) bytes stack frame"),
            "spill_store_bytes": num(r"(\d+) bytes spill stores"), "spill_load_bytes": num(r"(\d+) bytes spill loads")}


def resources(kernel: str, state: str | None, t: int, warps: int, capability: int) -> dict:
    """One row: ``kernel`` compiled for ``capability`` (90: sm_90a) with a ``state`` pool (None: a kernel without
    one) and the tile (``t``, warps)."""
    fn, sig, tile_name, constexprs, _ = KERNELS[kernel]
    const = constexprs(t)
    signature = dict(p.split(":") for p in sig.split())
    signature = {k: "*" + STATE_TYPES[state] if v == "*S" else v for k, v in signature.items()}
    signature.update({name: "constexpr" for name in const})
    compiled = triton.compile(ASTSource(fn, signature=signature, constexprs=const),
                              target=GPUTarget("cuda", capability, 32), options={"num_warps": warps})  # fmt: skip
    arch = f"sm_{capability}" + ("a" if capability >= 90 else "")
    report = ptxas_report(compiled.asm["ptx"], arch)
    return {"kernel": kernel, "state_dtype": state, tile_name: t, "num_warps": warps, "arch": arch, **report,
            "resident_warps": resident_warps(report["registers"], warps)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default="gdn_step,gdn_verify", help=f"comma-separated, of {', '.join(KERNELS)}")
    ap.add_argument("--states", default=None, help="the GDN kernels' state pools (default float32,bfloat16)")
    ap.add_argument("--tiles", type=tiles, default=None, help="BVxwarps (GDN) or ROWSxwarps (adamw8bit), "
                    "comma-separated (default: each kernel's own list)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability (90: H100 / H200)")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    kernels = args.kernels.split(",")
    if unknown := [k for k in kernels if k not in KERNELS]:
        ap.error(f"--kernels: unknown {unknown}; known: {', '.join(KERNELS)}")
    if args.states is not None and not any("*S" in KERNELS[k][1] for k in kernels):
        ap.error("--states: the GDN kernels' state pools; none of --kernels has one")
    rows = []
    for k in kernels:
        states = (args.states or "float32,bfloat16").split(",") if "*S" in KERNELS[k][1] else [None]
        rows += [resources(k, s, t, w, args.arch) for s in states for t, w in args.tiles or tiles(KERNELS[k][4])]
    print_table(rows, ["kernel", "state_dtype", "BV", "rows", "num_warps", "arch", "registers", "stack_bytes",
                       "spill_store_bytes", "spill_load_bytes", "resident_warps"])  # fmt: skip
    print("STEP_CONFIG now:", {str(k).removeprefix("torch."): v for k, v in gdn_decode.STEP_CONFIG.items()})
    if not args.no_save:
        print("results:", append_jsonl("kernel_resources", rows, env_info()))


if __name__ == "__main__":
    main()

"""Fine-tune deltas: coded bytes over the fine-tune's bytes, encode and apply speed.

    python benchmarks/delta_codec.py --json                  # 4M words, 0.3%, 1%, 3% updates
    python benchmarks/delta_codec.py --quick --json          # CI-sized
    python benchmarks/delta_codec.py --device cuda --json    # adds the Triton kernel's speed
    python benchmarks/delta_codec.py --dtype float32 --json  # what a CPU serves

Weights: `--words` weights of `--dtype` (bf16 by default), Gaussian with std 0.02 (the base). The fine-tune moves them by an
Adam-like update of `fraction` of their RMS: Adam normalises each weight's step, so every weight
moves by about the same amount whatever its size (`update = fraction * rms * z`, z ~ N(0, 1));
small weights then move by many units in the last place, which is where escapes come from.

Per fraction: the delta's bytes (`DeltaBuffer.nbytes`) over the fine-tune's bf16 bytes, split
into the stream (with lane offsets and table) and the escapes; the share of escaped words; two
entropies in bits per word, of the byte symbols and of the full 16-bit delta (the latter bounds
what any code of one word at a time could reach, whatever its symbol map); and the DFloat ratio of
the fine-tune alone, for contrast. Speeds, on `--threads` CPU threads (numpy's encoder is
single-threaded): encode in words/s (best of `--repeats`), the apply in 16-bit words/s of the
torch reference and of the C++ decoder (kernels/lane_native.py, what the CPU runs; absent with
the reason when it cannot be built), and on CUDA the Triton apply in words/s and GB/s of words
read and written, each checked bitwise (the fine-tune's words after sign=1, the base's after
sign=-1). For contrast, DFloat's decode of the fine-tune (the same lane code) by both decoders.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from weight_formats_device import timed  # noqa: E402

from megaslide.kernels import lane_native  # noqa: E402
from megaslide.kernels.delta import delta_apply, delta_apply_native  # noqa: E402
from megaslide.kernels.delta_reference import BIAS, delta_apply_reference, delta_encode  # noqa: E402
from megaslide.kernels.dfloat_reference import (  # noqa: E402
    dfloat_decode_reference,
    dfloat_encode,
)


def entropy_bits(values: np.ndarray, bins: int) -> float:
    """Order-0 entropy of integer values in [0, bins), in bits per value."""
    p = np.bincount(values, minlength=bins) / max(values.size, 1)
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def fine_tune_pair(
    words: int, fraction: float, seed: int, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(words, generator=g) * 0.02
    rms = base.square().mean().sqrt()
    tuned = base + fraction * rms * torch.randn(words, generator=g)
    return base.to(dtype), tuned.to(dtype)


def measure(
    weights: int, fraction: float, repeats: int, device: torch.device, dtype: torch.dtype
) -> dict:
    base, tuned = fine_tune_pair(weights, fraction, seed=0, dtype=dtype)
    base_words, tuned_words = base.view(torch.int16), tuned.view(torch.int16)
    words = base_words.numel()  # 16-bit words: two a weight in fp32
    coded = delta_encode(base, tuned)
    encode_s = timed(lambda: delta_encode(base, tuned), torch.device("cpu"), repeats)
    delta = (tuned_words.numpy().view(np.uint16) - base_words.numpy().view(np.uint16)).astype(
        np.int64
    )  # mod 2**16
    symbols = np.minimum((delta + BIAS) % 2**16, 255)
    raw = 2 * words
    escape_nbytes = sum(
        t.numel() * t.element_size()
        for t in (coded.escape_offsets, coded.escape_index, coded.escape_value)
    )

    def apply_both(dev: torch.device, apply=delta_apply) -> tuple[float, bool]:
        """Seconds of one apply (timed as a switch there and back, which needs no reset), and
        whether sign=1 gives the fine-tune's words and sign=-1 the base's, bitwise."""
        buffer, w = coded.to(dev), base_words.to(dev, copy=True)

        def there_and_back():
            apply(buffer, w)
            apply(buffer, w, sign=-1)

        seconds = timed(there_and_back, dev, repeats) / 2
        apply(buffer, w)
        ok = torch.equal(w.cpu(), tuned_words)
        apply(buffer, w, sign=-1)
        return seconds, ok and torch.equal(w.cpu(), base_words)

    cpu = torch.device("cpu")
    ref_s, ref_ok = apply_both(cpu, delta_apply_reference)
    dfloat = dfloat_encode(tuned)
    out = torch.empty(dfloat.num_words, dtype=torch.int16)
    dfloat_ref_s = timed(lambda: dfloat_decode_reference(*dfloat.parts(), out), cpu, repeats)
    row = {
        "fraction_of_rms": fraction,
        "ratio": coded.nbytes / raw,
        "bits_per_word": 8 * coded.nbytes / words,
        "stream_ratio": (coded.nbytes - escape_nbytes) / raw,
        "escape_ratio": escape_nbytes / raw,
        "escaped_words": coded.num_escapes / words,
        "changed_words": float((delta != 0).mean()),
        "symbol_entropy_bits": entropy_bits(symbols, 256),
        "delta_entropy_bits": entropy_bits(delta, 2**16),
        "dfloat_ratio_of_tuned": dfloat.nbytes / raw,
        "encode_words_per_s": words / encode_s,
        "reference_apply_words_per_s": words / ref_s,
        "reference_bitwise": ref_ok,
        "dfloat_reference_decode_words_per_s": words / dfloat_ref_s,
    }
    native = lane_native.load()
    if native is not None:
        native_s, native_ok = apply_both(cpu, delta_apply_native)
        row["native_apply_words_per_s"] = words / native_s
        row["native_bitwise"] = native_ok
        row["native_vs_reference"] = ref_s / native_s
        decode_s = timed(lambda: native.dfloat_decode(*dfloat.parts(), out), cpu, repeats)
        row["dfloat_native_decode_words_per_s"] = words / decode_s
        row["dfloat_native_bitwise"] = torch.equal(out, tuned_words)
    if device.type == "cuda":
        kernel_s, kernel_ok = apply_both(device)
        row["triton_apply_words_per_s"] = words / kernel_s
        row["triton_apply_gbps"] = 4 * words / kernel_s / 1e9  # every word read and written
        row["triton_bitwise"] = kernel_ok
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--words", type=int, default=4 * 2**20, help="weights per tensor")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--fractions", default="0.003,0.01,0.03", help="update sizes, of the RMS")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CI)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.words, args.repeats = 65536, 1
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    fractions = [float(f) for f in args.fractions.split(",")]
    dtype = getattr(torch, args.dtype)
    result = {
        "weights": args.words,
        "dtype": args.dtype,
        "threads": args.threads,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "native": str(lane_native.load().path)
        if lane_native.load() is not None
        else {"unavailable": lane_native.unavailable_reason()},
        "rows": [measure(args.words, f, args.repeats, device, dtype) for f in fractions],
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for r in result["rows"]:
            print(
                f"update {r['fraction_of_rms']:.1%} of RMS: {r['ratio']:.3f}x the bytes "
                f"({r['bits_per_word']:.2f} bits/word, escapes {r['escaped_words']:.2%} of words), "
                f"encode {r['encode_words_per_s'] / 1e6:.0f}M words/s, "
                f"reference apply {r['reference_apply_words_per_s'] / 1e6:.0f}M words/s, "
                f"native {r.get('native_apply_words_per_s', 0) / 1e6:.0f}M words/s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

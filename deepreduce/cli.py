"""The ``deepreduce`` command: compress, decompress, inspect and benchmark tensors."""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np

import deepreduce as dr
from deepreduce import container
from deepreduce.bundle import BUNDLE_MAGIC, split_bundles
from deepreduce.pipeline import (DEFAULT_INDEX, DEFAULT_MAX_NNZ, DEFAULT_MAX_SCANNED,
                                 DEFAULT_VALUE, Pipeline, index_entropy_bits)
from deepreduce.registry import registered_codecs


def _codec_help(family: str) -> str:
    lines = []
    for codec_id, cls in sorted(registered_codecs(family).items()):
        doc = inspect.getdoc(cls) or ""
        summary = doc.splitlines()[0] if doc else ""
        params = ", ".join(f"{p.name}={p.default!r}" for p in cls._parameters())
        kind = "lossless" if cls.lossless else "lossy"
        lines.append(f"  {codec_id:<12} {summary} [{kind}]")
        if params:
            lines.append(f"  {'':<12}   params: {params}")
    return "\n".join(lines)


def _epilog() -> str:
    return textwrap.dedent("""\
        sparsifiers (--sparsifier):
          none               every non-zero entry (the default)
          topk:R | topk:k=K  the largest magnitudes: a fraction R in (0, 1] or a count K;
                             topk:R,exact=true partitions the whole tensor instead of sampling
          randomk:R,seed=S   a random fraction R (or k=K), reproducible from S
          threshold:T        entries with |x| > T
          blocktopk:R,block=B  whole blocks of B elements, the fraction R of largest L2 norm
          chunktopk:k=K,chunk=C  exactly K of largest magnitude in every chunk of C (matrices
                             in square tiles of side sqrt(C); best with --index chunked)

        index codecs (--index, default %s):
        %s

        value codecs (--value, default %s):
        %s

        A codec spec sets parameters after a colon: zstd:level=9, qsgd:bits=4,bucket=256.
        """) % (DEFAULT_INDEX, _codec_help("index"), DEFAULT_VALUE, _codec_help("value"))


def _load_arrays(path: Path, key: str | None = None) -> dict[str, np.ndarray]:
    """Arrays of a .npy or .npz file, by name; IndexedSlices side arrays are skipped."""
    if not path.exists():
        raise SystemExit(f"deepreduce: no such file: {path}")
    loaded = np.load(path, allow_pickle=False)
    if isinstance(loaded, np.ndarray):
        return {path.stem: loaded}
    with loaded:
        names = [name for name in loaded.files if ".indexed_" not in name]
        if key is not None:
            if key not in loaded.files:
                raise SystemExit(f"deepreduce: {path} has no array {key!r}; it has {names}")
            names = [key]
        return {name: loaded[name] for name in names}


def _cmd_compress(args) -> int:
    arrays = _load_arrays(Path(args.input), args.key)
    if len(arrays) != 1:
        raise SystemExit(f"deepreduce: {args.input} holds {len(arrays)} arrays; "
                         "choose one with --key NAME")
    (x,) = arrays.values()
    payload, received = Pipeline(args.sparsifier, args.index, args.value).encode(x)
    output = Path(args.output or Path(args.input).with_suffix(".drz"))
    output.write_bytes(payload)
    dense_bytes = x.size * x.dtype.itemsize
    print(f"{output}: {len(payload)} bytes, nnz {received.nnz} of {x.size}, "
          f"{dense_bytes / max(len(payload), 1):.1f}x smaller than the dense {x.dtype} tensor")
    return 0


def _decompress(payload, args) -> dr.SparseTensor:
    """``dr.decompress`` with the bounds of the command line (0: no bound)."""
    if args.max_elements is None:
        return dr.decompress(payload, args.max_nnz or None, args.max_scanned or None)
    print("deepreduce: --max-elements is deprecated (the declared shape no longer bounds the "
          "cost of decoding); use --max-nnz and --max-scanned", file=sys.stderr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return dr.decompress(payload, args.max_nnz or None, args.max_scanned or None,
                             max_elements=args.max_elements or None)


def _cmd_decompress(args) -> int:
    st = _decompress(Path(args.input).read_bytes(), args)
    output = Path(args.output or Path(args.input).with_suffix(".npy"))
    if args.sparse:
        np.savez(output, values=st.values, indices=st.indices, shape=np.array(st.shape))
    else:
        np.save(output, st.to_dense())
    print(f"{output}: shape {st.shape}, dtype {st.dtype}, nnz {st.nnz}")
    return 0


def _payload_info(payload, args) -> tuple[dict, dr.SparseTensor | None]:
    """What ``inspect`` prints of one payload, and with ``--check`` what it decodes to."""
    header, _, _ = container.unpack(payload)
    nnz = header.nnz
    info = {
        "format_version": header.version,
        "shape": list(header.shape),
        "dtype": str(header.dtype),
        "nnz": nnz,
        "density": nnz / header.size if header.size else 0.0,
        "index_codec": header.index_spec or "value-order (bit-packed)",
        "value_codec": header.value_spec,
        "header_bytes": header.header_length,
        "index_bytes": header.index_length,
        "value_bytes": header.value_length,
        "crc_bytes": 4,
        "total_bytes": len(payload),
        "index_bits_per_nnz": 8 * header.index_length / nnz if nnz else 0.0,
        "value_bits_per_nnz": 8 * header.value_length / nnz if nnz else 0.0,
        "total_bits_per_nnz": 8 * len(payload) / nnz if nnz else 0.0,
        "index_entropy_bound_bits": index_entropy_bits(header.size, nnz),
        "dense_bytes": header.size * header.dtype.itemsize,
    }
    decoded = None
    if args.check:
        decoded = _decompress(payload, args)
        info["decodes"] = True
    return info, decoded


def _bundle_info(data, args) -> dict:
    """What ``inspect`` prints of ``args.ranks`` concatenated bundles (an allgather's)."""
    bundles = []
    for bundle in split_bundles(data, args.ranks):
        tensors = [{"payload": slot, **({"shape": list(bundle.shapes[t])}
                                        if t in bundle.shapes else {})}
                   for t, slot in enumerate(bundle.slots)]
        read = [_payload_info(payload, args) for payload in bundle.payloads]
        if args.check:
            bundle.tensors([tensor for _, tensor in read])  # shared ones hold their tensors
        bundles.append({"bundle_version": bundle.data[len(BUNDLE_MAGIC)],
                        "total_bytes": len(bundle.data), "tensors": tensors,
                        "payloads": [info for info, _ in read]})
    return {"bundles": bundles}


def _print_fields(info: dict, indent: str = "") -> None:
    width = max(map(len, info))
    for key, value in info.items():
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        print(f"{indent}{key:<{width}}  {text}")


def _cmd_inspect(args) -> int:
    data = Path(args.input).read_bytes()
    bundle = data[:len(BUNDLE_MAGIC)] == BUNDLE_MAGIC
    info = _bundle_info(data, args) if bundle else _payload_info(data, args)[0]
    if args.json:
        print(json.dumps(info, indent=2))
    elif not bundle:
        _print_fields(info)
    else:
        for rank, read in enumerate(info["bundles"]):
            print(f"bundle {rank}: version {read['bundle_version']}, "
                  f"{read['total_bytes']} bytes, {len(read['tensors'])} tensors in "
                  f"{len(read['payloads'])} payloads")
            for t, tensor in enumerate(read["tensors"]):
                shape = f", shape {tuple(tensor['shape'])}" if "shape" in tensor else ""
                print(f"  tensor {t}: payload {tensor['payload']}{shape}")
            for number, payload in enumerate(read["payloads"]):
                print(f"  payload {number}:")
                _print_fields(payload, "    ")
    return 0


def _best_time(fn, repeat: int) -> tuple[float, object]:
    best, result = math.inf, None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def _bench_rows(arrays, sparsifier, repeat):
    """Measure every registered codec on the sparsified arrays; yield table rows."""
    pipe = Pipeline(sparsifier)
    selected = [pipe.sparsify(x) for x in arrays.values()]
    dense_bytes = sum(st.size * st.dtype.itemsize for st, _ in selected)
    nnz = sum(st.nnz for st, _ in selected)
    bound = sum(index_entropy_bits(st.size, st.nnz) * st.nnz for st, _ in selected)
    yield ("summary", dict(tensors=len(selected), elements=sum(st.size for st, _ in selected),
                           nnz=nnz, dense_bytes=dense_bytes, bound_bits=bound / max(nnz, 1)))
    for codec_id, cls in sorted(registered_codecs("index").items()):
        codec = cls()

        def encode_all():
            return [codec.encode_selection(st.indices, st.values, st.size, dense)
                    for st, dense in selected]
        t_enc, encoded = _best_time(encode_all, repeat)
        t_dec, _ = _best_time(lambda: [codec.decode(data, st.size, idx.size) for
                                       (data, idx, _), (st, _) in zip(encoded, selected)], repeat)
        size = sum(len(data) for data, _, _ in encoded)
        delivered = sum(idx.size for _, idx, _ in encoded)
        yield ("index", dict(codec=codec_id, lossless=cls.lossless, bytes=size,
                             bits=8 * size / max(nnz, 1), delivered=delivered,
                             enc=dense_bytes / t_enc / 1e6, dec=dense_bytes / t_dec / 1e6))
    for codec_id, cls in sorted(registered_codecs("value").items()):
        codec = cls()
        inputs = [st.values[codec.order(st.values)] if codec.sorts_values else st.values
                  for st, _ in selected]
        t_enc, encoded = _best_time(lambda: [codec.encode_and_receive(v) for v in inputs], repeat)
        t_dec, _ = _best_time(lambda: [codec.decode(data, v.size, v.dtype) for
                                       (data, _), v in zip(encoded, inputs)], repeat)
        size = sum(len(data) for data, _ in encoded)
        err = sum(float(np.sum((r.astype(np.float64) - v.astype(np.float64)) ** 2))
                  for (_, r), v in zip(encoded, inputs))
        norm = sum(float(np.sum(v.astype(np.float64) ** 2)) for v in inputs)
        yield ("value", dict(codec=codec_id, lossless=cls.lossless, bytes=size,
                             bits=8 * size / max(nnz, 1), sorts=codec.sorts_values,
                             rel_l2=math.sqrt(err / norm) if norm else 0.0,
                             enc=dense_bytes / t_enc / 1e6, dec=dense_bytes / t_dec / 1e6))


def _cmd_bench(args) -> int:
    arrays = _load_arrays(Path(args.input), args.key)
    rows = _bench_rows(arrays, args.sparsifier, args.repeat)
    _, s = next(rows)
    print(f"{args.input}: {s['tensors']} tensors, {s['elements']:,} elements, "
          f"sparsifier {args.sparsifier or 'none'} -> nnz {s['nnz']:,}; "
          f"entropy bound of the index sets {s['bound_bits']:.2f} bits/nnz")
    print("throughput is MB/s of dense input; raw Top-k pairs (int32 + fp32) cost 64 bits/nnz\n")
    header_done = set()
    for family, r in rows:
        if family not in header_done:
            header_done.add(family)
            if family == "index":
                print(f"{'index codec':<12} {'kind':<9} {'bytes':>11} {'bits/nnz':>9} "
                      f"{'x bound':>8} {'encode':>9} {'decode':>9}")
            else:
                print(f"\n{'value codec':<12} {'kind':<9} {'bytes':>11} {'bits/nnz':>9} "
                      f"{'rel. L2':>9} {'encode':>9} {'decode':>9}")
        kind = "lossless" if r["lossless"] else "lossy"
        if family == "index":
            ratio = r["bits"] / s["bound_bits"] if s["bound_bits"] else float("nan")
            extra = "" if r["delivered"] == s["nnz"] else f"  delivers {r['delivered']:,}"
            print(f"{r['codec']:<12} {kind:<9} {r['bytes']:>11,} {r['bits']:>9.2f} {ratio:>8.3f} "
                  f"{r['enc']:>9.0f} {r['dec']:>9.0f}{extra}")
        else:
            extra = "  (sorts values: indices travel in value order)" if r["sorts"] else ""
            print(f"{r['codec']:<12} {kind:<9} {r['bytes']:>11,} {r['bits']:>9.2f} "
                  f"{r['rel_l2']:>9.2e} {r['enc']:>9.0f} {r['dec']:>9.0f}{extra}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepreduce", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Compress sparse or sparsified tensors into self-describing payloads.",
        epilog=_epilog())
    parser.add_argument("--version", action="version", version=f"deepreduce {dr.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name, help_text, fn):
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=_epilog(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(fn=fn)
        return p

    p = add("compress", "compress a .npy array (or one array of an .npz) into a payload file",
            _cmd_compress)
    p.add_argument("input")
    p.add_argument("-o", "--output", help="payload file (default: INPUT with suffix .drz)")
    p.add_argument("--key", help="array name inside an .npz input")
    p.add_argument("--sparsifier", default=None, help="e.g. topk:0.01 (default: the non-zeros)")
    p.add_argument("--index", default=DEFAULT_INDEX, help=f"index codec spec (default {DEFAULT_INDEX})")
    p.add_argument("--value", default=DEFAULT_VALUE, help=f"value codec spec (default {DEFAULT_VALUE})")

    p = add("decompress", "decode a payload file back to a dense .npy array", _cmd_decompress)
    p.add_argument("input")
    p.add_argument("-o", "--output", help="output file (default: INPUT with suffix .npy)")
    p.add_argument("--sparse", action="store_true",
                   help="write an .npz with values, indices and shape instead of the dense array")
    _bound_options(p)

    p = add("inspect", "print a payload's header: shape, dtype, nnz, codecs, stream sizes, "
            "bits per nnz; for a bundle (the exchange's framing), which payload holds each "
            "tensor and every payload's header", _cmd_inspect)
    p.add_argument("input")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--check", action="store_true", help="also decode the streams")
    p.add_argument("--ranks", type=int, default=1,
                   help="a bundle file holds this many ranks' bundles, concatenated (default 1)")
    _bound_options(p)

    p = add("bench", "compare every registered codec on the arrays of a .npy/.npz file",
            _cmd_bench)
    p.add_argument("input")
    p.add_argument("--key", help="only this array of an .npz input")
    p.add_argument("--sparsifier", default="topk:0.01",
                   help="applied to each array before coding (default topk:0.01)")
    p.add_argument("--repeat", type=int, default=3, help="timing repetitions, best kept")
    return parser


def _bound_options(parser) -> None:
    parser.add_argument("--max-nnz", type=int, default=DEFAULT_MAX_NNZ,
                        help="refuse payloads declaring more non-zeros, before decoding "
                             f"(default {DEFAULT_MAX_NNZ:,}; 0 for no bound)")
    parser.add_argument("--max-scanned", type=int, default=DEFAULT_MAX_SCANNED,
                        help="refuse payloads whose decoding tests more positions of the "
                             "universe (Bloom-filter index streams: every element of the "
                             f"shape), before decoding (default {DEFAULT_MAX_SCANNED:,}; "
                             "0 for no bound)")
    # deprecated: the declared shape no longer bounds the cost of decoding
    parser.add_argument("--max-elements", type=int, default=None, help=argparse.SUPPRESS)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, OSError, MemoryError) as exc:  # DecodeError is a ValueError
        print(f"deepreduce {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

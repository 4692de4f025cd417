"""Move the real Whisper folders from ../shared/tools/real_models.py to an offline GPU machine
in pieces small enough for a size-limited transfer, losslessly.

    python bench/scripts/carry_real.py pack ~/.cache/enc2dec-real whisper-tiny.en .carry --piece-mb 40
    python bench/scripts/carry_real.py unpack .carry /tmp/real        # on the other machine

``pack`` stores the folder's float32 weights as float16 (they came from float16 CTranslate2
files, so float16 -> float32 on ``unpack`` restores every value bit for bit), tars the folder
and splits it into NAME.tar.partNN files. ``unpack`` joins every complete set of parts found,
restores float32 weights and leaves the folder under DEST, ready for ENC2DEC_REAL_MODELS.
A set is complete when NAME.tar.count's number of parts is present.
"""
from __future__ import annotations

import argparse
import io
import shutil
import tarfile
from pathlib import Path

import torch
from safetensors.torch import load, save


def pack(src_root: str, name: str, out: str, piece_mb: int) -> None:
    src, dst = Path(src_root) / name, Path(out)
    dst.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for f in sorted(src.iterdir()):
            if f.name == "model.safetensors":
                tensors = load(f.read_bytes())
                half = {k: v.to(torch.float16) if v.dtype == torch.float32 else v for k, v in tensors.items()}
                assert all(torch.equal(half[k].to(v.dtype), v) for k, v in tensors.items()), "not float16-exact"
                data = save(half, metadata={"format": "pt"})
                info = tarfile.TarInfo("model.fp16.safetensors")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.add(f, arcname=f.name)
    data, step = buf.getvalue(), piece_mb << 20
    parts = [data[i:i + step] for i in range(0, len(data), step)]
    for i, part in enumerate(parts):
        (dst / f"{name}.tar.part{i:02d}").write_bytes(part)
    (dst / f"{name}.tar.count").write_text(str(len(parts)))
    print(f"{name}: {len(data) / 1e6:.1f} MB in {len(parts)} parts under {dst}")


def unpack(carry: str, dest: str) -> None:
    root, out = Path(carry), Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    for count in sorted(root.rglob("*.tar.count")):
        name = count.name[:-len(".tar.count")]
        parts = sorted(root.rglob(f"{name}.tar.part*"))
        if len(parts) != int(count.read_text()) or (out / name / "config.json").exists():
            print(f"{name}: {len(parts)}/{count.read_text()} parts" + (" (already unpacked)" if parts else ""))
            continue
        target = out / (name + ".part")
        shutil.rmtree(target, ignore_errors=True)
        with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
            tar.extractall(target, filter="data")
        half = target / "model.fp16.safetensors"
        tensors = {k: v.to(torch.float32) if v.dtype == torch.float16 else v
                   for k, v in load(half.read_bytes()).items()}
        (target / "model.safetensors").write_bytes(save(tensors, metadata={"format": "pt"}))
        half.unlink()
        target.rename(out / name)
        print(f"{name}: unpacked to {out / name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("src_root"); p.add_argument("name"); p.add_argument("out")
    p.add_argument("--piece-mb", type=int, default=40)
    u = sub.add_parser("unpack")
    u.add_argument("carry"); u.add_argument("dest")
    a = ap.parse_args()
    pack(a.src_root, a.name, a.out, a.piece_mb) if a.cmd == "pack" else unpack(a.carry, a.dest)


if __name__ == "__main__":
    main()

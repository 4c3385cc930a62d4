#!/usr/bin/env python3
"""Compares the runs under two output folders of scripts/bit-identity/run.sh.

Per run: every step record's loss, accuracy, lr, ratio, payload bytes and sample count,
every evaluation, and every section of every checkpoint file (parameters, optimizer,
error-feedback memories, RNG streams) must be equal bit for bit; the checkpoint's copy of
config.toml is skipped (it names the output folder). Transport byte counts are reported
apart: with the parameter server and DLCP they depend on timing (pulls, retransmissions)
and differ between two runs of one binary. Exit status 1 when a run differs.

usage: compare.py OUT_BEFORE OUT_AFTER [--dropped PREFIX ...]
--dropped names checkpoint sections the change removed on purpose (e.g. `exchanger` and
`mem/` of parameter-server runs, which never used an exchanger): sections with such a prefix
that exist only in OUT_BEFORE are listed apart instead of counting as a difference."""
import json, os, struct, sys
args = sys.argv[1:]
dropped = args[args.index("--dropped") + 1:] if "--dropped" in args else []
if "--dropped" in args: args = args[:args.index("--dropped")]
base, new = args[0], args[1]
KEYS = ["step","epoch","loss","accuracy","lr","ratio_name","ratio","payload_bytes","skipped","samples"]
BYTES = ["bytes_sent","bytes_received"]
def runs(root):
    out = {}
    for d, subs, files in os.walk(root):
        if "metrics.jsonl" in files:
            rel = os.path.relpath(os.path.dirname(d), root)  # label/runname
            out[rel] = d
    return out
def sections(path):
    b = open(path, "rb").read()
    assert b[:8] == b"DTCKPT01"
    n = struct.unpack_from("<I", b, 8)[0]; at = 12; out = {}
    for _ in range(n):
        kl = struct.unpack_from("<I", b, at)[0]; at += 4
        k = b[at:at+kl].decode(); at += kl
        vl = struct.unpack_from("<Q", b, at)[0]; at += 8
        out[k] = b[at:at+vl]; at += vl
    return out
B, N = runs(base), runs(new)
bad = 0
for rel in sorted(B):
    if rel not in N:
        print(f"MISSING in new: {rel}"); bad += 1; continue
    b, n = B[rel], N[rel]
    mb = [json.loads(l) for l in open(f"{b}/metrics.jsonl")]
    mn = [json.loads(l) for l in open(f"{n}/metrics.jsonl")]
    diffs = [ (x["step"], k, x.get(k), y.get(k)) for x, y in zip(mb, mn) for k in KEYS if x.get(k) != y.get(k)]
    if len(mb) != len(mn): diffs.append(("len", len(mb), len(mn)))
    bdiff = sum(1 for x, y in zip(mb, mn) for k in BYTES if x.get(k) != y.get(k))
    eb = [(e["step"], e["loss"], e.get("accuracy")) for e in map(json.loads, open(f"{b}/eval.jsonl"))] if os.path.exists(f"{b}/eval.jsonl") else []
    en = [(e["step"], e["loss"], e.get("accuracy")) for e in map(json.loads, open(f"{n}/eval.jsonl"))] if os.path.exists(f"{n}/eval.jsonl") else []
    if eb != en: diffs.append(("eval", eb[-1:], en[-1:]))
    ck = []
    dropped_seen = set()
    cb = os.path.join(b, "checkpoints")
    if os.path.isdir(cb):
        for step in sorted(os.listdir(cb)):
            p = os.path.join(cb, step)
            if not os.path.isdir(p): continue
            for f in sorted(os.listdir(p)):
                sb = sections(os.path.join(p, f)); sn = sections(os.path.join(n, "checkpoints", step, f))
                gone = [k for k in sb if k not in sn and any(k.startswith(d) for d in dropped)]
                dk = [k for k in sorted(set(sb) | set(sn)) if k != "config.toml" and k not in gone and sb.get(k) != sn.get(k)]  # config.toml names the output dir
                ck.append((step, f, dk))
                dropped_seen.update(gone)
    ckbad = [c for c in ck if c[2]]
    status = "IDENTICAL" if not diffs and not ckbad else "DIFFERENT"
    if status != "IDENTICAL": bad += 1
    print(f"{status:9} {rel}: {len(mb)} steps, final loss {mb[-1]['loss']!r}, checkpoints compared: {len(ck)} files"
          + (f"; differing sections {ckbad}" if ckbad else "") + (f"; first diffs {diffs[:3]}" if diffs else "") + (f"; transport byte counts differ in {bdiff} step fields (timing-dependent)" if bdiff else "")
          + (f"; dropped on purpose: {sorted(dropped_seen)}" if dropped_seen else ""))
print(f"{len(B)} runs, {bad} different")
sys.exit(1 if bad else 0)

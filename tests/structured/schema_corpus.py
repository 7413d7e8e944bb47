#!/usr/bin/env python3
"""Structured output against real-world JSON schemas (tests/fixtures/schemastore).

  python3 tests/structured/schema_corpus.py --infer target/release/infer --model MODEL [--every N]
      [--only NAME,NAME] [--show]

Asks infer (one `run --batch-file` process, requests in parallel) for an instance of every Nth
schema and sorts each outcome: `valid` (jsonschema accepts it), `refused` (infer declined the
schema with a reason), `cut` (the token budget ran out mid-structure: finish reason `length`) or
`INVALID` (a finished output that does not validate: the one outcome that must never happen).
Prints a line per schema and the totals; exits 1 on any INVALID, or a refusal without a reason.
"""
import argparse, collections, json, os, subprocess, sys, tempfile

import jsonschema

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "fixtures", "schemastore")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--infer", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=600)
    ap.add_argument("--only", default="", help="comma-separated schema file names (no .json)")
    ap.add_argument("--show", action="store_true", help="print each output's last 160 bytes")
    a = ap.parse_args()
    names = sorted(f for f in os.listdir(CORPUS) if f.endswith(".json"))[:: a.every]
    if a.only:
        names = [f for f in names if f[:-5] in a.only.split(",")]
    schemas = [json.load(open(os.path.join(CORPUS, f), encoding="utf-8")) for f in names]
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as batch:
        for name, s in zip(names, schemas):
            title = (s.get("title") if isinstance(s, dict) else None) or name[:-5]
            desc = (s.get("description") or "")[:200] if isinstance(s, dict) else ""
            prompt = f"A short example of a {title} JSON file" + (f" ({desc})" if desc else "") + ":\n"
            batch.write(json.dumps({"prompt": prompt, "json_schema": s, "max_tokens": a.max_tokens}) + "\n")
    # Sampling with a mild repetition penalty: greedy decoding of a 270M model loops in strings.
    run = subprocess.run(
        [a.infer, "run", "-m", a.model, "--batch-file", batch.name, "--parallel", "8",
         "--temp", "0.6", "--repeat-penalty", "1.15", "--seed", "1"],
        capture_output=True, text=True)
    os.unlink(batch.name)
    lines = run.stdout.splitlines()
    if len(lines) != len(names):
        sys.exit(f"expected {len(names)} result lines, got {len(lines)}: {run.stderr[-2000:]}")
    counts = collections.Counter()
    for name, s, line in zip(names, schemas, lines):
        r = json.loads(line)
        if "error" in r:
            ok = "invalid JSON schema:" in r["error"] and len(r["error"]) > len("invalid JSON schema: ")
            counts["refused" if ok else "INVALID"] += 1
            print(f"{'refused' if ok else 'INVALID'} {name}: {r['error'].splitlines()[0]}")
            continue
        try:
            jsonschema.validate(json.loads(r["text"]), s)
            counts["valid"] += 1
            print(f"valid   {name} ({r['generated_tokens']} tokens)")
        except (ValueError, jsonschema.ValidationError) as e:
            kind = "cut" if r["stop"] == "length" else "INVALID"
            counts[kind] += 1
            print(f"{kind:7} {name}: {str(e).splitlines()[0][:120]}")
            if a.show:
                print("        ..." + json.dumps(r["text"][-160:]))
    total = len(names)
    print(f"{total} schemas: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"supported (compiled): {total - counts['refused']}/{total}; "
          f"valid: {counts['valid']}; cut by the budget: {counts['cut']}; invalid: {counts['INVALID']}")
    sys.exit(1 if counts["INVALID"] else 0)


if __name__ == "__main__":
    main()

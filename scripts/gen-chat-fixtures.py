#!/usr/bin/env python3
"""Generate tests/fixtures/chat/cases.json: chat templates and the prompts Python jinja2 renders
from them exactly as transformers' `apply_chat_template` does (its own helper: an
ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and the loopcontrols extension, a
json.dumps `tojson` filter and the `raise_exception` / `strftime_now` globals; render arguments
messages, tools=None, documents=None, add_generation_prompt and the special-token strings).

Templates: the one inside the Qwen2.5-Coder GGUF (read with the `gguf` package), every
`chat_template` in ../shared/fixtures/hf-tiny/*/tokenizer_config.json, and a few well-known
public templates (Mistral/Llama-2 and Gemma style, which `raise_exception` on bad conversations;
Llama-3 style) plus one that exercises Python string methods, tojson, namespace and loop controls.

Usage: pip install jinja2 gguf; scripts/gen-chat-fixtures.py [--models DIR] [--shared DIR]
"""

import argparse
import json
import os
import sys
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Python-isms that transformers' templates rely on, with block tags on their own lines (trim_blocks
# and lstrip_blocks matter), printed booleans/None/lists (Python's str()), and tojson variants.
FEATURES = """{%- set ns = namespace(n=0, sys=none) %}
{% for m in messages %}
    {% if m.role == 'system' %}
        {% set ns.sys = m.content %}
        {% continue %}
    {% endif %}
    {% set ns.n = ns.n + 1 %}
    {{ ns.n }}. {{ m.role.upper() }}: {{ m.content.strip() }}
    json={{ m | tojson }} hi={{ m.content.startswith('Hi') }} words={{ m.content.split(' ') | length }}
    {% if ns.n >= 3 %}
        {% break %}
    {% endif %}
{% endfor %}
system={{ ns.sys }} tools={{ tools }} nested={{ [1, 2.5, 'a', none, true, {'k': 'v'}] }}
{{ {'a': [1, 2.5, none, true, false], 'b': "x\\"y\\\\z", 'c': 1e20, 'd': 0.0001} | tojson }}
{{ messages[-1] | tojson(indent=2) }}
{{ {'z': 1, 'a': 2} | tojson(sort_keys=true) }}
{% if add_generation_prompt %}
ASSISTANT:
{% endif %}"""

CONVERSATIONS = {
    "system_user": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Hi! What is 2+2?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ],
    "no_system": [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
    "ends_with_assistant": [
        {"role": "user", "content": "Say yes."},
        {"role": "assistant", "content": "Yes."},
    ],
    "unicode_quotes": [
        {"role": "system", "content": "Réponds en français, s'il te plaît.\n\tMerci ✓"},
        {
            "role": "user",
            "content": "  He said \"hi\" and 'bye' \\ back\\slash; 中文 😀 {{ not a tag }} {% raw %}\n",
        },
        {"role": "assistant", "content": "D'accord — « oui » ! </s> <|im_end|>"},
        {"role": "user", "content": "Hi\u00a0again \u0000 ctrl \u001b[0m"},
    ],
    "not_alternating": [
        {"role": "user", "content": "one"},
        {"role": "user", "content": "two"},
    ],
}


def transformers_env():
    """The environment transformers' `_compile_jinja_template` builds (minus its generation-tracking
    extension, which only matters for `{% generation %}` blocks)."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def qwen_template(models_dir):
    import gguf

    r = gguf.GGUFReader(os.path.join(models_dir, QWEN))
    f = r.fields["tokenizer.chat_template"]
    src = bytes(f.parts[f.data[0]]).decode("utf-8")
    # transformers' Qwen2.5 tokenizer_config has bos_token null; the template uses neither.
    return {"name": "qwen2.5-coder-gguf", "source": src, "bos_token": None, "eos_token": "<|im_end|>"}


def hf_tiny_templates(shared_dir):
    base = os.path.join(shared_dir, "fixtures", "hf-tiny")
    out = []
    for d in sorted(os.listdir(base)):
        p = os.path.join(base, d, "tokenizer_config.json")
        if not os.path.exists(p):
            continue
        with open(p, encoding="utf-8") as fh:
            cfg = json.load(fh)
        src = cfg.get("chat_template")
        if not isinstance(src, str):
            continue

        def tok(v):
            return v.get("content") if isinstance(v, dict) else v

        out.append(
            {
                "name": "hf-tiny/" + d,
                "source": src,
                "bos_token": tok(cfg.get("bos_token")),
                "eos_token": tok(cfg.get("eos_token")),
            }
        )
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=os.path.join(ROOT, "models"))
    ap.add_argument("--shared", default=os.path.join(os.path.dirname(ROOT), "shared"))
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "chat", "cases.json"))
    args = ap.parse_args()

    templates = [qwen_template(args.models)] + hf_tiny_templates(args.shared)
    templates += [
        {"name": "mistral-style", "source": MISTRAL, "bos_token": "<s>", "eos_token": "</s>"},
        {"name": "gemma-style", "source": GEMMA, "bos_token": "<bos>", "eos_token": "<eos>"},
        {"name": "llama3-style", "source": LLAMA3, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        {"name": "python-features", "source": FEATURES, "bos_token": "<s>", "eos_token": "</s>"},
    ]

    env = transformers_env()
    cases = []
    for t in templates:
        compiled = env.from_string(t["source"])
        special = {k: t[k] for k in ("bos_token", "eos_token") if t[k] is not None}
        for conv, messages in CONVERSATIONS.items():
            for agp in (True, False):
                case = {"template": t["name"], "conversation": conv, "add_generation_prompt": agp}
                try:
                    case["expected"] = compiled.render(
                        messages=messages, tools=None, documents=None, add_generation_prompt=agp, **special
                    )
                except jinja2.exceptions.TemplateError as e:
                    case["error"] = str(e)
                cases.append(case)

    doc = {
        "generator": "scripts/gen-chat-fixtures.py (jinja2 %s, transformers' environment)" % jinja2.__version__,
        "templates": templates,
        "conversations": CONVERSATIONS,
        "cases": cases,
    }
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, ensure_ascii=False, indent=1)
        fh.write("\n")
    n_err = sum(1 for c in cases if "error" in c)
    print(f"wrote {args.out}: {len(templates)} templates, {len(cases)} cases ({n_err} raise)", file=sys.stderr)


if __name__ == "__main__":
    main()

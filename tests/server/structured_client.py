#!/usr/bin/env python3
"""Structured output and tool calls of `infer serve`, through the official `openai` client.

  python3 tests/server/structured_client.py --url http://127.0.0.1:8080

The server runs Qwen2.5-Coder with `--temp 0`. Outputs are checked with Python's `jsonschema`
(independent of the engine that constrained them). Prints one line per check; exits 1 on a failure.
"""
import argparse, json, sys, urllib.request

import jsonschema
import openai

failures = []


def check(name, cond, detail=""):
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else f": {detail}"), flush=True)
    if not cond:
        failures.append(name)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}},
            "required": ["zone"],
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    ask = [{"role": "user", "content": "Describe a fictional programmer as JSON."}]

    # response_format: json_schema (strict), json_object.
    r = client.chat.completions.create(
        model=model, messages=ask, max_tokens=120,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    text = r.choices[0].message.content
    try:
        jsonschema.validate(json.loads(text), PERSON)
        check("json_schema answer validates", True)
    except Exception as e:  # noqa: BLE001 - any failure is the finding
        check("json_schema answer validates", False, f"{text!r}: {e}")
    check("json_schema answer ends as the model would", r.choices[0].finish_reason == "stop",
          r.choices[0].finish_reason)

    r = client.chat.completions.create(model=model, messages=ask, max_tokens=120,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content
    try:
        check("json_object answer is an object", isinstance(json.loads(text), dict), text)
    except ValueError as e:
        check("json_object answer is an object", False, f"{text!r}: {e}")

    # A schema the engine cannot enforce is refused, naming why, never ignored.
    try:
        client.chat.completions.create(
            model=model, messages=ask, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "array", "uniqueItems": True}}})
        check("unsupported schema keyword is a 400", False, "answered 200")
    except openai.BadRequestError as e:
        body = e.body or {}
        check("unsupported schema keyword is a 400",
              "uniqueItems" in str(body) and body.get("param") == "response_format", str(body))
    try:
        client.chat.completions.create(model=model, messages=ask, max_tokens=8,
                                       response_format={"type": "xml"})
        check("unknown response_format is a 400", False, "answered 200")
    except openai.BadRequestError:
        check("unknown response_format is a 400", True)

    # Tool calls: required, parsed, arguments valid under the parameters schema.
    q = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    r = client.chat.completions.create(model=model, messages=q, max_tokens=100,
                                       tools=[WEATHER, TIME], tool_choice="required")
    c = r.choices[0]
    calls = c.message.tool_calls or []
    check("required: finish_reason tool_calls", c.finish_reason == "tool_calls", c.finish_reason)
    check("required: at least one call", len(calls) >= 1, repr(c.message))
    for call in calls:
        params = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
        try:
            jsonschema.validate(json.loads(call.function.arguments), params)
            check(f"required: {call.function.name} arguments validate", True)
        except Exception as e:  # noqa: BLE001
            check(f"required: {call.function.name} arguments validate", False,
                  f"{call.function.arguments!r}: {e}")
    check("required: the model picked the weather tool",
          calls and calls[0].function.name == "get_weather", repr(calls))

    # A named function.
    r = client.chat.completions.create(
        model=model, messages=q, max_tokens=100, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = r.choices[0].message.tool_calls or []
    check("named: only get_time is called",
          len(calls) >= 1 and all(x.function.name == "get_time" for x in calls), repr(calls))

    r = client.chat.completions.create(model=model, messages=q, max_tokens=200, tools=[WEATHER, TIME],
                                       tool_choice="required", parallel_tool_calls=False)
    check("parallel_tool_calls false: exactly one call",
          len(r.choices[0].message.tool_calls or []) == 1, repr(r.choices[0].message))

    # Streaming: the call arrives as delta.tool_calls, no stray content.
    stream = client.chat.completions.create(model=model, messages=q, max_tokens=100,
                                            tools=[WEATHER], tool_choice="required", stream=True)
    deltas, content, finish = [], "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        deltas.extend(d.tool_calls or [])
        finish = chunk.choices[0].finish_reason or finish
    check("stream: one tool_calls delta with valid arguments",
          len(deltas) >= 1 and deltas[0].function.name == "get_weather"
          and isinstance(json.loads(deltas[0].function.arguments), dict), repr(deltas))
    check("stream: no content, finish_reason tool_calls", content == "" and finish == "tool_calls",
          f"{content!r} {finish}")

    # The follow-up turn: the call and its result rendered by the model's template.
    first = calls_for_followup = client.chat.completions.create(
        model=model, messages=q, max_tokens=100, tools=[WEATHER], tool_choice="required")
    msg = first.choices[0].message
    call = msg.tool_calls[0]
    follow = q + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})},
    ]
    body = json.dumps({"messages": follow, "tools": [WEATHER]}).encode()
    req = urllib.request.Request(a.url + "/apply-template", data=body,
                                 headers={"Content-Type": "application/json"})
    prompt = json.loads(urllib.request.urlopen(req, timeout=60).read())["prompt"]
    args = json.loads(call.function.arguments)
    check("follow-up: the template renders the call as JSON",
          '<tool_call>\n{"name": "get_weather", "arguments": {' in prompt
          and json.dumps(args["city"]) in prompt, prompt[-600:])
    check("follow-up: the template renders the tool result",
          "<tool_response>" in prompt and '"temperature": 18' in prompt, prompt[-400:])
    r = client.chat.completions.create(model=model, messages=follow, max_tokens=60, tools=[WEATHER])
    m = r.choices[0].message
    check("follow-up: answered in text", bool(m.content) and not m.tool_calls, repr(m))

    # Bad tool requests.
    for name, kw in [
        ("tool_choice naming an unknown function",
         dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})),
        ("tool_choice required without tools", dict(tool_choice="required")),
    ]:
        try:
            client.chat.completions.create(model=model, messages=q, max_tokens=8, **kw)
            check(f"{name} is a 400", False, "answered 200")
        except openai.BadRequestError:
            check(f"{name} is a 400", True)

    print(f"{len(failures)} failed" if failures else "all passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

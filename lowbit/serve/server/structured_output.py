"""OpenAI's `response_format`, `tools` and `tool_choice` -> a StructuredSpec for the engine, the tools' description
for the prompt, and the generated text -> `message.tool_calls` (OpenAI's shapes).

tool_choice "required" or a named function: the output is a JSON array of calls [{"name", "arguments"}] (named, or
parallel_tool_calls false: exactly one; a small model may repeat calls until max_tokens when several are allowed). "auto" (the default with tools): free text in which a call is written
<tool_call>{"name": ..., "arguments": ...}</tool_call>; the grammar constrains what follows <tool_call>.
"none": plain text (the tools are still described in the prompt).
"""
import json
import re
import uuid

from lowbit.serve.engine.sampling_params import StructuredSpec
from lowbit.serve.engine.structured import TOOL_BEGIN, TOOL_END
from lowbit.serve.server.protocol import APIError

_TAGGED = re.compile(re.escape(TOOL_BEGIN) + r"(.*?)" + re.escape(TOOL_END), re.DOTALL)


def response_format_spec(response_format: dict | None) -> StructuredSpec | None:
    """{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}} -> spec."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json_object")
    if kind == "json_schema":
        body = response_format.get("json_schema")
        schema = body.get("schema") if isinstance(body, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema needs json_schema.schema, a JSON schema object",
                           param="response_format")
        return StructuredSpec("json_schema", schema=schema)
    raise APIError(400, "response_format type must be 'text', 'json_object' or 'json_schema'",
                   param="response_format")


def function_tools(tools: list | None) -> list[dict]:
    """OpenAI `tools` -> [{"name", "description", "parameters"}]; 400 for a malformed one."""
    out = []
    for t in tools or []:
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        name = f.get("name") if isinstance(f, dict) else None
        params = f.get("parameters", {"type": "object", "properties": {}}) if isinstance(f, dict) else None
        if not isinstance(name, str) or not name or not isinstance(params, dict):
            raise APIError(400, "each tool must be {'type': 'function', 'function': {'name': str, "
                           "'parameters': JSON schema object}}", param="tools")
        out.append({"name": name, "description": f.get("description") or "", "parameters": params})
    if len({t["name"] for t in out}) != len(out):
        raise APIError(400, "tool names must be unique", param="tools")
    return out


def tools_spec(tools: list[dict], tool_choice, parallel: bool | None = None) -> StructuredSpec | None:
    """tools from `function_tools`, tool_choice "none" | "auto" | "required" | {"type": "function",
    "function": {"name"}} (None: "auto" with tools) -> spec (None: unconstrained). parallel (OpenAI's
    parallel_tool_calls): False allows one call only."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):  # nothing to call: "auto" is plain text
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    schema_tools = tuple({"name": t["name"], "parameters": t["parameters"]} for t in tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    if choice == "auto":
        return StructuredSpec("tool_tags", tools=schema_tools)
    if choice == "required":
        return StructuredSpec("tool_calls", tools=schema_tools, single=parallel is False)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    named = [t for t in schema_tools if t["name"] == name]
    if not named:
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                       "{'name': <one of the tools>}}", param="tool_choice")
    return StructuredSpec("tool_calls", tools=tuple(named), single=True)


def tools_prompt(tools: list[dict], spec: StructuredSpec | None) -> str:
    """A system message describing the tools and how to call them, for chat templates without tool support."""
    listed = json.dumps([{"type": "function", "function": t} for t in tools])
    if spec is None or spec.kind == "tool_tags":
        how = (f"To call a function, write {TOOL_BEGIN}{{\"name\": <function name>, \"arguments\": <arguments "
               f"object>}}{TOOL_END}.")
    else:
        how = "Reply with a JSON array of function calls, each {\"name\": <function name>, \"arguments\": <object>}."
    return f"You can call these functions:\n{listed}\n{how}"


def tool_calls(text: str, spec: StructuredSpec) -> tuple[str | None, list[dict]]:
    """A tool-mode output -> (content or None, [OpenAI tool call]). Text that does not parse (cut by max_tokens)
    stays content with no calls."""
    calls: list = []
    if spec.kind == "tool_calls":
        try:
            calls = json.loads(text)
        except ValueError:
            return text, []
        content = None
    else:
        for body in _TAGGED.findall(text):
            try:
                calls.append(json.loads(body))
            except ValueError:
                return text, []
        content = _TAGGED.sub("", text).strip() or None
    return content, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in calls]

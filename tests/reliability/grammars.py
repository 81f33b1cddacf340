"""Hostile schemas and regexes shared by the gRPC fuzzer (test_fuzz.py) and the HTTP schemathesis test."""
from __future__ import annotations

# Schemas and regexes as clients write them, the ones grammars choke on among them (issue #73): a recursive $ref
# every value must take, recursion with a way out, pydantic's $defs, JSON pointers into the schema, and nested
# repetitions of 10^6 states. Each is served or refused (INVALID_ARGUMENT), never INTERNAL mid-generation.
GRAMMARS: dict[str, list[str]] = {
    "json_schema": [
        '{"$ref": "#"}',
        '{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}',
        '{"type": "object", "properties": {"name": {"type": "string"}, "children": {"type": "array", '
        '"items": {"$ref": "#"}, "maxItems": 2}}, "required": ["name"]}',
        '{"$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}, '
        '"type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"]}',
        '{"$defs": {"Node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}}, '
        '"required": ["next"]}}, "$ref": "#/$defs/Node"}',
        '{"definitions": {"a": {"type": "integer"}}, "type": "object", "properties": {"x": {"$ref": '
        '"#/definitions/a"}, "y": {"$ref": "#/properties/x"}}}',
        '{"$ref": "#/$defs/missing"}',
        '{"type": "string", "pattern": "^(.{1,1000}){1000}$"}',
        '{"type": "object", "properties": {"s": {"type": "string", "pattern": "(x{1000}){1000}"}}, "required": ["s"]}',
    ],
    "regex": ["^(.{1,1000}){1000}$", "(x{1000}){1000}", "(a|aa)*b", "((a+)+)+c", "[a-z]{1,100000}"],
}

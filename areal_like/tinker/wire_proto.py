"""The protobuf messages the `tinker` SDK sends (forward / forward_backward requests) and
expects back (their outputs, and samples), built at import from the schema below: no code
generation step, and the field numbers and types live in one readable table. A test checks
them against the SDK's own descriptor (tests/test_tinker_wire.py)."""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_PACKAGE = "areal_like.tinker_wire"
_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {"string": _F.TYPE_STRING, "bytes": _F.TYPE_BYTES, "bool": _F.TYPE_BOOL,
            "int32": _F.TYPE_INT32, "int64": _F.TYPE_INT64, "uint32": _F.TYPE_UINT32,
            "double": _F.TYPE_DOUBLE, "float": _F.TYPE_FLOAT}
_ENUMS = {"DType": ["DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32",
                    "DTYPE_BFLOAT16"],
          "StopReason": ["STOP_REASON_STOP", "STOP_REASON_LENGTH"]}

# message -> fields "name number type"; type: a scalar, an enum or message name, prefixed by
# "repeated " or "optional " (proto3 optional), or "map<key,value>"; "oneof X:" before a field
# puts it in oneof X.
_SCHEMA: dict[str, list[str]] = {
    "ForwardBackwardRequest": [
        "model_id 1 string", "seq_id 2 int32", "data 3 repeated Datum", "loss_fn 4 string",
        "loss_fn_config 5 map<string,double>", "forward_only 6 bool",
        "loss_fn_config_v2 7 map<string,LossConfigValue>"],
    "LossConfigValue": ["oneof value: number 1 double", "oneof value: text 2 string"],
    "Datum": ["model_input 1 repeated Chunk", "loss_fn_inputs 2 map<string,Tensor>",
              "model_input_spans 3 repeated ProvenanceSpan",
              "loss_fn_input_spans 4 repeated ProvenanceSpan"],
    "Chunk": ["oneof chunk: encoded_text 1 EncodedTextChunk", "oneof chunk: image 2 ImageChunk",
              "oneof chunk: dmel 3 DmelChunk"],
    "EncodedTextChunk": ["tokens 1 bytes"],
    "ImageChunk": ["data 1 bytes", "format 2 string", "expected_tokens 3 optional int32",
                   "override_dimensions 4 optional ImageDimensions"],
    "ImageDimensions": ["width 1 uint32", "height 2 uint32"],
    "DmelChunk": ["dmel 1 bytes"],
    "Tensor": ["oneof encoding: dense 1 bytes", "oneof encoding: sparse_csr 2 SparseCsr",
               "dtype 3 DType", "shape 4 repeated int64"],
    "SparseCsr": ["values 1 bytes", "crow_indices 2 bytes", "col_indices 3 bytes"],
    "ProvenanceSpan": ["oneof span: prompt_tokens 1 PromptProvenanceSpan",
                       "oneof span: sampled_tokens 2 SampledProvenanceSpan"],
    "PromptProvenanceSpan": ["sequence_id 1 string", "offset 2 int64", "length 3 int64"],
    "SampledProvenanceSpan": ["sequence_id 1 string", "offset 2 int64", "length 3 int64"],
    "ForwardBackwardOutput": ["loss_fn_output_type 1 string",
                              "loss_fn_outputs 2 repeated ArrayRecord",
                              "metrics 3 map<string,double>"],
    "ArrayRecord": ["type_tag 1 string", "fields 2 map<string,BatchedTensor>",
                    "num_datums 3 int64"],
    "BatchedTensor": ["data 1 bytes", "offsets 2 bytes", "dtype 3 DType",
                      "trailing_shape 4 repeated int64"],
    "SampleResponse": ["sequences 1 repeated SampledSequence", "prompt_logprobs 2 optional bytes",
                       "topk_prompt_logprobs 3 optional TopkLogprobs",
                       "prompt_cache_hit_tokens 4 int32",
                       "target_prompt_logprobs 5 optional Tensor",
                       "prompt_alt_tokens 6 optional PromptAltTokens"],
    "SampledSequence": ["stop_reason 1 StopReason", "tokens 2 bytes", "logprobs 3 optional bytes",
                        "topk_sampled_logprobs 4 optional TopkLogprobs"],
    "TopkLogprobs": ["token_ids 1 bytes", "logprobs 2 bytes", "k 3 uint32", "length 4 uint32"],
    "PromptAltTokens": ["tokens 1 Tensor", "logprobs 2 Tensor"],
}


def _set_type(field: Any, type_name: str) -> None:
    if type_name in _SCALARS:
        field.type = _SCALARS[type_name]
    else:
        field.type = _F.TYPE_ENUM if type_name in _ENUMS else _F.TYPE_MESSAGE
        field.type_name = f".{_PACKAGE}.{type_name}"


def _add_message(file: Any, name: str, fields: list[str]) -> None:
    message = file.message_type.add(name=name)
    oneofs: list[str] = []
    for spec in fields:
        oneof, _, spec = spec.rpartition(": ")
        field_name, number, kind = spec.split(" ", 2)
        field = message.field.add(name=field_name, number=int(number), label=_F.LABEL_OPTIONAL)
        if oneof:
            group = oneof.removeprefix("oneof ")
            if group not in oneofs:
                oneofs.append(group)
                message.oneof_decl.add(name=group)
            field.oneof_index = oneofs.index(group)
        if kind.startswith("map<"):
            key, value = kind[4:-1].split(",")
            entry = message.nested_type.add(name=f"{_camel(field_name)}Entry")
            entry.options.map_entry = True
            _set_type(entry.field.add(name="key", number=1, label=_F.LABEL_OPTIONAL), key)
            _set_type(entry.field.add(name="value", number=2, label=_F.LABEL_OPTIONAL), value)
            field.label = _F.LABEL_REPEATED
            field.type = _F.TYPE_MESSAGE
            field.type_name = f".{_PACKAGE}.{name}.{entry.name}"
            continue
        if kind.startswith("repeated "):
            field.label = _F.LABEL_REPEATED
            kind = kind.removeprefix("repeated ")
        elif kind.startswith("optional "):  # proto3 optional: a synthetic oneof of its own
            kind = kind.removeprefix("optional ")
            field.proto3_optional = True
            oneofs.append(f"_{field_name}")
            message.oneof_decl.add(name=f"_{field_name}")
            field.oneof_index = len(oneofs) - 1
        _set_type(field, kind)
    # synthetic oneofs must come after the real ones
    real = [o.name for o in message.oneof_decl if not o.name.startswith("_")]
    order = real + [o.name for o in message.oneof_decl if o.name.startswith("_")]
    if order != [o.name for o in message.oneof_decl]:
        raise AssertionError(f"{name}: declare a oneof's fields before optional fields")


def _camel(snake: str) -> str:
    return "".join(part.capitalize() for part in snake.split("_"))


def build_file() -> descriptor_pb2.FileDescriptorProto:
    file = descriptor_pb2.FileDescriptorProto(name="areal_like_tinker_wire.proto",
                                              package=_PACKAGE, syntax="proto3")
    for enum_name, values in _ENUMS.items():
        enum = file.enum_type.add(name=enum_name)
        for number, value in enumerate(values):
            enum.value.add(name=value, number=number)
    for name, fields in _SCHEMA.items():
        _add_message(file, name, fields)
    return file


_POOL = descriptor_pool.DescriptorPool()
_FILE = _POOL.Add(build_file())
_CLASSES = message_factory.GetMessages([build_file()], pool=_POOL)


def message_class(name: str) -> Any:
    return _CLASSES[f"{_PACKAGE}.{name}"]


ForwardBackwardRequest = message_class("ForwardBackwardRequest")
ForwardBackwardOutput = message_class("ForwardBackwardOutput")
SampleResponse = message_class("SampleResponse")
DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32, DTYPE_BFLOAT16 = 1, 2, 3, 4
STOP_REASON_STOP, STOP_REASON_LENGTH = 0, 1

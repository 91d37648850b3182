"""The kernel source `mx.fast.metal_kernel` builds around a body, written as MLX does.

A port of `write_signature`, `write_template`, `make_template_hash` and the kernel-name
rules in mlx/backend/common/metal_kernel.cpp (MLX 0.32), so the emulator compiles the
same text a Mac would.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

# Inputs with fewer elements are passed in the constant address space.
MAX_CONSTANT_ARRAY_SIZE = 8

# (attribute, type) in MLX's order; each is added when its name occurs in the source.
METAL_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

_TYPE_STRINGS = {
    mx.float32: "float",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.float64: "double",
    mx.complex64: "complex64_t",
    mx.bool_: "bool",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
}

TemplateArg = bool | int | mx.Dtype


def type_string(dtype: mx.Dtype) -> str:
    """MLX's `get_type_string`."""
    try:
        return _TYPE_STRINGS[dtype]
    except KeyError:
        raise RuntimeError(f"Unsupported compilation type {dtype}") from None


@dataclass(frozen=True)
class InputSpec:
    """What the signature needs to know about one input array."""

    name: str
    dtype: mx.Dtype
    ndim: int
    size: int

    @property
    def constant(self) -> bool:
        return self.size < MAX_CONSTANT_ARRAY_SIZE


def shape_infos(source: str, input_names: list[str]) -> list[tuple[bool, bool, bool]]:
    """Which of `<name>_shape`, `_strides`, `_ndim` the source mentions (plain substring)."""
    return [
        (f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source)
        for n in input_names
    ]


def attributes(source: str) -> list[tuple[str, str]]:
    """Thread-position attributes whose name occurs in the source (MLX's order)."""
    return [(a, t) for a, t in METAL_ATTRIBUTES if a in source]


def _template_value(arg: TemplateArg) -> str:
    if isinstance(arg, bool):  # before int: bool is an int in Python
        return str(int(arg))
    if isinstance(arg, int):
        return str(arg)
    return type_string(arg)


def _template_kind(arg: TemplateArg) -> str:
    if isinstance(arg, bool):
        return "bool"
    if isinstance(arg, int):
        return "int"
    return "typename"


def write_template(template: list[tuple[str, TemplateArg]]) -> str:
    return "<" + ", ".join(_template_value(a) for _, a in template) + ">"


def make_template_hash(template_def: str) -> str:
    out = []
    i = 0
    while i < len(template_def):
        c = template_def[i]
        if c in "<>":
            out.append("_")
        elif c == "," and i + 1 < len(template_def) and template_def[i + 1] == " ":
            out.append("_")
            i += 1
        else:
            out.append(c)
        i += 1
    return "".join(out)[:-1]


def kernel_name(
    name: str,
    inputs: list[InputSpec],
    output_dtypes: list[mx.Dtype],
    template: list[tuple[str, TemplateArg]],
) -> str:
    """`custom_kernel_<name>[_<template hash>]_<input types + s|c>_<output types>`."""
    kname = "custom_kernel_" + name
    if template:
        kname += "_" + make_template_hash(write_template(template))
    for spec in inputs:
        kname += "_" + type_string(spec.dtype)
        if spec.ndim == 0:
            kname += "s"
        elif spec.constant:
            kname += "c"
    for dt in output_dtypes:
        kname += "_" + type_string(dt)
    return kname


def write_signature(
    func_name: str,
    header: str,
    source: str,
    inputs: list[InputSpec],
    output_names: list[str],
    output_dtypes: list[mx.Dtype],
    template: list[tuple[str, TemplateArg]],
    attrs: list[tuple[str, str]],
    infos: list[tuple[bool, bool, bool]],
    atomic_outputs: bool,
) -> str:
    """The full kernel source: header, template line, signature, body (MLX's text exactly)."""
    ks = header
    if template:
        ks += "template <" + ", ".join(f"{_template_kind(a)} {n}" for n, a in template) + ">\n"
    ks += f"[[kernel]] void {func_name}(\n"
    index = 0
    for spec, (has_shape, has_strides, has_ndim) in zip(inputs, infos, strict=True):
        location = "constant" if spec.constant else "device"
        ref = "&" if spec.ndim == 0 else "*"
        ks += (
            f"  const {location} {type_string(spec.dtype)}{ref} {spec.name} [[buffer({index})]],\n"
        )
        index += 1
        if spec.ndim > 0:
            if has_shape:
                ks += f"  const constant int* {spec.name}_shape [[buffer({index})]],\n"
                index += 1
            if has_strides:
                ks += f"  const constant int64_t* {spec.name}_strides [[buffer({index})]],\n"
                index += 1
            if has_ndim:
                ks += f"  const constant int& {spec.name}_ndim [[buffer({index})]],\n"
                index += 1
    for name, dt in zip(output_names, output_dtypes, strict=True):
        t = type_string(dt)
        if atomic_outputs:
            t = f"atomic<{t}>"
        ks += f"  device {t}* {name} [[buffer({index})]]"
        # MLX compares the running buffer index with inputs + outputs - 1 (its quirk, kept).
        if index < len(inputs) + len(output_names) - 1 or attrs:
            ks += ",\n"
        else:
            ks += ") {\n"
        index += 1
    for j, (attr, t) in enumerate(attrs):
        ks += f"  {t} {attr} [[{attr}]]"
        ks += ",\n" if j < len(attrs) - 1 else ") {\n"
    ks += source
    ks += "\n}\n"
    if template:
        tdef = func_name + write_template(template)
        ks += f'\ntemplate [[host_name("{func_name}")]] [[kernel]] decltype({tdef}) {tdef};\n'
    return ks

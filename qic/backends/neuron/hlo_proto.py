"""Read and annotate serialized `HloModuleProto`s without the protobuf package or XLA's generated code.

Only the few fields qic needs, by their numbers in XLA's `xla/service/hlo.proto` (proto3):

    HloModuleProto       name 1, entry_computation_name 2, computations 3, entry_computation_id 6
    HloComputationProto  name 1, instructions 2, id 5, root_id 6
    HloInstructionProto  name 1, opcode 2, parameter_number 9, id 35, replica_groups 49,
                         frontend_attributes 68
    ReplicaGroup         replica_ids 1 (xla_data.proto)
    ShapeProto           element_type 2, dimensions 3, tuple_shapes 4 (xla_data.proto)
    FrontendAttributes   map<string, string> map 1 (entries: key 1, value 2)

Uses: name the entry parameters and outputs the way the Neuron toolchain expects (frontend attributes
`neff_input_names` = "input<i>" on parameter i and `neff_output_names` on the root, so the NEFF's tensors
are named by position; see qic/backends/neuron/nrt.py), and count opcodes and replica groups for
inspection and tests. Every field this module does not touch is copied through byte for byte.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

VARINT, I64, LEN, I32 = 0, 1, 2, 5

Field = tuple[int, int, bytes | int]   # (number, wire type, raw bytes for LEN / value for VARINT / raw for I32, I64)


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _encode_varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # proto int64: two's complement, ten bytes
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def fields(buf: bytes) -> Iterator[Field]:
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == VARINT:
            value, pos = _varint(buf, pos)
        elif wire == LEN:
            n, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + n], pos + n
        elif wire == I64:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == I32:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} (field {number})")
        yield number, wire, value


def encode(items: list[Field]) -> bytes:
    out = bytearray()
    for number, wire, value in items:
        out += _encode_varint(number << 3 | wire)
        if wire == VARINT:
            out += _encode_varint(value)
        elif wire == LEN:
            out += _encode_varint(len(value)) + value
        else:
            out += value
    return bytes(out)


def _get(items, number, default=None):
    for n, _, v in items:
        if n == number:
            return v
    return default


def _attributes(pairs: dict[str, str]) -> bytes:
    return encode([(1, LEN, encode([(1, LEN, k.encode()), (2, LEN, v.encode())])) for k, v in pairs.items()])


def _read_attributes(instruction: list[Field]) -> dict[str, str]:
    out = {}
    for n, _, v in instruction:
        if n == 68:
            for _, _, entry in fields(v):
                e = list(fields(entry))
                out[_get(e, 1, b"").decode()] = _get(e, 2, b"").decode()
    return out


def _with_attributes(instruction: list[Field], pairs: dict[str, str]) -> list[Field]:
    merged = {**_read_attributes(instruction), **pairs}
    return [f for f in instruction if f[0] != 68] + [(68, LEN, _attributes(merged))]


def _entry(module: list[Field]) -> int:
    entry_id = _get(module, 6)
    if entry_id is None:  # proto3 omits a zero id
        entry_id = 0
    return entry_id


def name_entry_tensors(proto: bytes) -> bytes:
    """The module with neff_input_names on every entry parameter and neff_output_names on the root."""
    module = list(fields(proto))
    entry_id = _entry(module)
    out, found = [], False
    for number, wire, value in module:
        if number == 3:
            comp = list(fields(value))
            if (_get(comp, 5) or 0) == entry_id:
                found = True
                value = encode(_name_computation(comp))
        out.append((number, wire, value))
    if not found:
        raise ValueError("HLO module has no entry computation")
    return encode(out)


def _name_computation(comp: list[Field]) -> list[Field]:
    root = _get(comp, 6) or 0
    instrs = [list(fields(v)) for n, _, v in comp if n == 2]
    by_id = {(_get(i, 35) or 0): i for i in instrs}
    root_instr = by_id[root]
    outputs = 1
    if _get(root_instr, 2, b"") == b"tuple":
        outputs = sum(1 for n, _, _ in root_instr if n == 36)
    out = []
    for number, wire, value in comp:
        if number == 2:
            instr = list(fields(value))
            if _get(instr, 2, b"") == b"parameter":
                instr = _with_attributes(instr, {"neff_input_names": f"input{_get(instr, 9) or 0}"})
            if (_get(instr, 35) or 0) == root:
                names = ",".join(f"output{j}" for j in range(outputs))
                instr = _with_attributes(instr, {"neff_output_names": names})
            value = encode(instr)
        out.append((number, wire, value))
    return out


def reorder_parameters(proto: bytes, new_number: list[int]) -> bytes:
    """The module with entry parameter i renumbered new_number[i] (a permutation), the entry's and the
    module's program shapes permuted to match. Operands refer to instruction ids, not parameter
    numbers, so nothing else changes."""
    if sorted(new_number) != list(range(len(new_number))):
        raise ValueError("new_number must be a permutation of the parameter numbers")
    module = list(fields(proto))
    entry_id = _entry(module)
    out = []
    for number, wire, value in module:
        if number == 3:
            comp = list(fields(value))
            if (_get(comp, 5) or 0) == entry_id:
                value = encode(_renumber_computation(comp, new_number))
        elif number == 4:  # host_program_shape
            value = encode(_permute_shape(list(fields(value)), new_number))
        out.append((number, wire, value))
    return encode(out)


def _renumber_computation(comp: list[Field], new_number: list[int]) -> list[Field]:
    out = []
    for number, wire, value in comp:
        if number == 2:
            instr = list(fields(value))
            if _get(instr, 2, b"") == b"parameter":
                old = _get(instr, 9) or 0
                instr = [f for f in instr if f[0] != 9] + [(9, VARINT, new_number[old])]
            value = encode(instr)
        elif number == 4:  # program_shape
            value = encode(_permute_shape(list(fields(value)), new_number))
        out.append((number, wire, value))
    return out


def _permute_shape(shape: list[Field], new_number: list[int]) -> list[Field]:
    """ProgramShapeProto: parameters 1 and parameter_names 3 reordered, result 2 kept."""
    params = [f for f in shape if f[0] == 1]
    names = [f for f in shape if f[0] == 3]
    rest = [f for f in shape if f[0] not in (1, 3)]

    def permuted(items):
        if len(items) != len(new_number):
            return items
        placed = [None] * len(items)
        for old, item in enumerate(items):
            placed[new_number[old]] = item
        return placed

    return permuted(params) + rest + permuted(names)


def instructions(proto: bytes, entry_only: bool = False) -> Iterator[list[Field]]:
    module = list(fields(proto))
    entry_id = _entry(module)
    for number, _, value in module:
        if number == 3:
            comp = list(fields(value))
            if entry_only and (_get(comp, 5) or 0) != entry_id:
                continue
            for n, _, v in comp:
                if n == 2:
                    yield list(fields(v))


def opcodes(proto: bytes, entry_only: bool = False) -> Counter:
    """How many instructions of each opcode, over every computation (loop bodies included) or the entry's only."""
    return Counter(_get(i, 2, b"").decode() for i in instructions(proto, entry_only))


def replica_groups(proto: bytes, opcode: str = "all-reduce") -> list[list[list[int]]]:
    """Per instruction of `opcode`: its replica groups as lists of replica ids."""
    groups = []
    for instr in instructions(proto):
        if _get(instr, 2, b"").decode() != opcode:
            continue
        groups.append([_ints(list(fields(v)), 1) for n, _, v in instr if n == 49])
    return groups


ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                 "s64": 8, "u64": 8, "f64": 8}


def collective_bytes(proto: bytes, opcodes_: tuple[str, ...]) -> dict[str, int]:
    """Per opcode: the bytes of its instructions' results summed (what each rank holds after the collective:
    the reduced tensor, the gathered one, the exchanged one), over every computation once. torch-xla's
    all-reduce returns (data, ordering token scalar): only the data counts (qic's
    collectives carry no 0-dim tensor), while its all-to-all is in tuple form, one element per rank's block,
    all of which count."""
    out = {op: 0 for op in opcodes_}
    for instr in instructions(proto):
        op = _get(instr, 2, b"").decode()
        if op in out:
            for dtype, dims in _shape(_get(instr, 3, b"")):
                n = ELEMENT_BYTES.get(dtype, 0) if dims else 0   # the 0-dim token: no data
                for d in dims:
                    n *= d
                out[op] += n
    return out


def entry_attributes(proto: bytes) -> dict[str, dict[str, str]]:
    """name -> frontend attributes, for the entry computation's instructions that have any."""
    out = {}
    for instr in instructions(proto, entry_only=True):
        attrs = _read_attributes(instr)
        if attrs:
            out[_get(instr, 1, b"").decode()] = attrs
    return out


# xla_data.proto PrimitiveType numbers -> names (the ones qic's graphs use).
ELEMENT_TYPES = {1: "pred", 2: "s8", 3: "s16", 4: "s32", 5: "s64", 6: "u8", 7: "u16", 8: "u32", 9: "u64",
                 10: "f16", 11: "f32", 12: "f64", 16: "bf16"}


def _ints(items, number) -> list[int]:
    out = []
    for n, w, v in items:
        if n == number and w == LEN:   # packed
            pos = 0
            while pos < len(v):
                val, pos = _varint(v, pos)
                out.append(val)
        elif n == number:
            out.append(v)
    return out


def _shape(raw: bytes) -> list[tuple[str, list[int]]]:
    """A ShapeProto as [(element type, dims)], tuples flattened one level."""
    items = list(fields(raw))
    parts = [v for n, _, v in items if n == 4]
    if parts:
        return [s for p in parts for s in _shape(p)]
    return [(ELEMENT_TYPES.get(_get(items, 2) or 0, "other"), _ints(items, 3))]


def entry_signature(proto: bytes) -> tuple[list[tuple[str, list[int]]], list[tuple[str, list[int]]]]:
    """(parameters in parameter-number order, outputs) of the entry computation, as (type, dims)."""
    module = list(fields(proto))
    entry_id = _entry(module)
    for number, _, value in module:
        if number != 3:
            continue
        comp = list(fields(value))
        if (_get(comp, 5) or 0) != entry_id:
            continue
        root = _get(comp, 6) or 0
        params, outputs = {}, []
        for n, _, v in comp:
            if n != 2:
                continue
            instr = list(fields(v))
            if _get(instr, 2, b"") == b"parameter":
                params[_get(instr, 9) or 0] = _shape(_get(instr, 3, b""))[0]
            if (_get(instr, 35) or 0) == root:
                outputs = _shape(_get(instr, 3, b""))
        return [params[i] for i in sorted(params)], outputs
    raise ValueError("HLO module has no entry computation")

"""What the bindings share about the C structs: the tensor view entry points take
(`struct v1_view`), the check of every ctypes mirror against the layout the library reports
(`v1_layout`, csrc/layout.c), so that a library whose structs differ from the mirrors (built
from other headers) is refused with `LayoutError` at bind time instead of reading fields where
it wrote others, and `packer`: a mirror's bytes in one `struct.pack` (building ctypes objects
per call cost more than a batch-1 kernel's own checks)."""

import ctypes
import functools
import struct


class LayoutError(RuntimeError):
    """A ctypes mirror disagrees with the library's struct."""


class CStruct(ctypes.Structure):
    """A mirror of a C struct: `c_name` is its name in csrc/ (`struct <c_name>`)."""

    c_name = ""


class View(CStruct):
    """`struct v1_view`: rows x cols elements, row i at data + i * stride (in elements; bytes
    for block-quantized weights)."""

    c_name = "v1_view"
    _fields_ = [("data", ctypes.c_void_p), ("rows", ctypes.c_int64), ("cols", ctypes.c_int64),
                ("stride", ctypes.c_int64)]


class _Field(ctypes.Structure):
    """`struct v1_field` of csrc/layout.c (checked by its use: its own layout is fixed)."""

    _fields_ = [("type", ctypes.c_char_p), ("field", ctypes.c_char_p),
                ("offset", ctypes.c_int64), ("size", ctypes.c_int64)]


def c_layout(lib: ctypes.CDLL) -> dict[str, dict[str | None, tuple[int, int]]]:
    """The library's structs: name -> {field or None (the whole struct): (offset, size)}."""
    return _layout(lib)


@functools.cache
def _layout(lib: ctypes.CDLL) -> dict[str, dict[str | None, tuple[int, int]]]:
    fn = lib.v1_layout
    fn.argtypes = [ctypes.POINTER(ctypes.c_int32)]
    fn.restype = ctypes.POINTER(_Field)
    count = ctypes.c_int32()
    rows = fn(ctypes.byref(count))
    out: dict[str, dict[str | None, tuple[int, int]]] = {}
    for i in range(count.value):
        f = rows[i]
        out.setdefault(f.type.decode(), {})[f.field.decode() if f.field else None] = (
            f.offset, f.size)
    return out


def check_layout(layout: dict[str, dict[str | None, tuple[int, int]]],
                 *mirrors: type[CStruct]) -> None:
    """Raise LayoutError unless each mirror has its C struct's size and exactly its fields, at
    the same offsets and of the same sizes."""
    for mirror in mirrors:
        c = layout.get(mirror.c_name)
        if c is None:
            raise LayoutError(f"the kernel library has no struct {mirror.c_name} "
                              f"({mirror.__name__}'s): rebuild it (`make kernels`)")
        ours = {None: (0, ctypes.sizeof(mirror))}
        for name, *_ in mirror._fields_:
            field = getattr(mirror, name)
            ours[name] = (field.offset, field.size)
        if ours != c:
            diff = sorted(str(k) for k in ours.keys() | c.keys() if ours.get(k) != c.get(k))
            raise LayoutError(
                f"struct {mirror.c_name}: {mirror.__name__} disagrees with the library's layout "
                f"on {', '.join(diff)} (ours {ours}, the library's {c}): rebuild the library "
                f"(`make kernels`) or fix the mirror")


# struct codes of the field types the mirrors use (a pointer is passed as its address, 0 for
# NULL).
_CODES = {ctypes.c_void_p: "Q", ctypes.c_char_p: "Q", ctypes.c_int64: "q",
          ctypes.c_int32: "i", ctypes.c_float: "f"}


def packer(mirror: type[ctypes.Structure]) -> struct.Struct:
    """A `struct.Struct` that packs `mirror`'s bytes from its fields' values, nested structs'
    fields in place, in declaration order (padding as the mirror has it): the bytes can be
    passed where the C takes a `const struct *` (a `c_char_p` argument)."""
    fmt: list[str] = []
    end = 0

    def walk(cls: type[ctypes.Structure], base: int) -> None:
        nonlocal end
        for name, ctype, *_ in cls._fields_:
            offset = base + getattr(cls, name).offset
            if offset > end:
                fmt.append(f"{offset - end}x")
                end = offset
            if issubclass(ctype, ctypes.Structure):
                walk(ctype, offset)
                continue
            fmt.append(_CODES[ctype])
            end += ctypes.sizeof(ctype)

    walk(mirror, 0)
    if ctypes.sizeof(mirror) > end:
        fmt.append(f"{ctypes.sizeof(mirror) - end}x")
    packed = struct.Struct("=" + "".join(fmt))
    assert packed.size == ctypes.sizeof(mirror), (mirror, packed.format)
    return packed

"""The dtype codes of the tensor file format (safetensors') and the torch dtypes they name; no torch,
so the manifest's validation (the launcher's pre-flight) can check them too."""

TORCH_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
}

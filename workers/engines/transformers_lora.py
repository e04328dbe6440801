"""The CPU engine's LoRA adapters (peft): once one is loaded every forward goes through the PeftModel,
each row of the batch with its adapter's name (peft's mixed-batch inference; BASE_ADAPTER for the base
model's rows). Only the engine's torch thread touches them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llamamesh.errors import InvalidRequest, NotFound

# peft's name for "no adapter" in a mixed batch (peft.tuners.lora: adapter_names).
BASE_ADAPTER = "__base__"


class PeftAdapters:
    def __init__(self, model: Any) -> None:
        self._model = model
        self._peft: Any = None
        self.names: set[str] = set()

    def load(self, name: str, path: str) -> None:
        """Load the PEFT adapter folder ``path`` as ``name``. NotFound if it is not there;
        InvalidRequest if peft cannot load it for this model."""
        if name in self.names:
            return
        if not Path(path).expanduser().is_dir():
            raise NotFound(f"adapter {name!r}: no folder {path!r}")
        from peft import PeftModel

        try:
            if self._peft is None:
                self._peft = PeftModel.from_pretrained(self._model, str(Path(path).expanduser()), adapter_name=name)
                self._peft.eval()
            else:
                self._peft.load_adapter(str(Path(path).expanduser()), adapter_name=name)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise InvalidRequest.field("adapter", f"cannot load adapter {name!r} from {path!r}: {exc}") from exc
        self.names.add(name)

    def unload(self, name: str) -> None:
        """Drop adapter ``name`` (its running requests must have ended: the engine checks)."""
        if name not in self.names:
            return
        self.names.discard(name)
        if not self.names:  # the last one: the model gets its own layers back
            self._peft.unload()
            self._peft = None
            return
        self._peft.delete_adapter(name)
        self._peft.set_adapter(sorted(self.names)[0])  # peft needs an active one (rows name theirs)

    def forward(self, adapters: Sequence[str | None], **kwargs: Any) -> Any:
        """The model's forward over rows whose adapters are ``adapters`` (None: the base model)."""
        if self._peft is None:
            return self._model(**kwargs)
        return self._peft(**kwargs, adapter_names=[a or BASE_ADAPTER for a in adapters])

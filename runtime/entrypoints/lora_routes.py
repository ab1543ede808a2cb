"""vLLM's run-time LoRA endpoints: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

The work runs on the engine thread between steps (AsyncEngine.call), through methods that the
engine and the engine-core process's client both have (load_lora, remove_lora). A bad path, a rank over
--max-lora-rank, a target the model lacks or a name already loaded is a 4xx naming the
reason. Unloading lets the adapter's requests already in the engine finish with it.
"""

from __future__ import annotations

from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from shoal.runtime.engine.async_engine import EngineDead, EngineNotReady
from shoal.runtime.engine.lora_manager import LoraError
from shoal.runtime.entrypoints.errors import APIError, unavailable


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace an adapter of that name


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def add_lora_routes(app, state) -> None:
    async def on_engine(fn):
        state.check_accepting()
        try:
            return await state.engine.call(fn)
        except LoraError as e:
            raise APIError(e.status, str(e), "invalid_request_error" if e.status == 400 else "not_found_error",
                           param="lora_name") from None
        except (EngineNotReady, EngineDead) as e:
            raise unavailable(str(e), "not_ready") from None

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        if req.lora_name in (state.model_name, state.config.model):
            raise APIError(400, f"'{req.lora_name}' is the base model's name", param="lora_name")

        await on_engine(lambda engine: engine.load_lora(req.lora_name, req.lora_path, replace=req.load_inplace))
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        await on_engine(lambda engine: engine.remove_lora(req.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

"""Methods added to each vLLM worker process (vLLM's `worker_extension_cls`).

Called by name through `LLM.collective_rpc`; they run next to the model's tensors, so a
check of what the engine holds moves a few floats across processes, not the weights, and a
reload reads the files straight onto the model's device.
"""

from __future__ import annotations


class WeightProbe:
    def parameter_sizes(self) -> dict[str, list[int]]:
        """Name -> shape of every parameter that holds data in this worker.

        Some backends repack fused layers into kernel-specific buffers and leave the
        parameter empty; those are left out, as they cannot be compared with a file."""
        return {name: list(p.shape) for name, p in self.model_runner.model.named_parameters() if p.numel() > 0}

    def parameter_sums(self, blocks_by_name: dict[str, list[tuple[int, int]]]) -> dict[str, float]:
        """Float64 sum of the given [start, stop) row blocks of each named parameter (blocks lie
        within the checkpoint's rows: the engine may pad a vocabulary dimension beyond them)."""
        import torch

        params = dict(self.model_runner.model.named_parameters())
        names = [name for name in blocks_by_name if name in params and params[name].numel() > 0]
        # Every block's sum queued on the device, then read back once: a single wait for the device,
        # which a colocated trainer's kernels keep busy, instead of one per block.
        sums = [
            torch.stack([params[name].detach()[a:b].double().sum() for a, b in blocks_by_name[name]]).sum()
            for name in names
        ]
        return dict(zip(names, torch.stack(sums).tolist(), strict=True)) if sums else {}

    def engine_facts(self) -> dict:
        """How this worker runs the model: eager or with CUDA graphs, and how many it captured."""
        runner = self.model_runner
        if hasattr(runner, "cudagraph_manager"):  # vLLM's V2 GPU model runner (dense models, 0.25 on)
            captured = len(runner.cudagraph_manager.graphs) if runner.cudagraph_manager is not None else 0
        elif hasattr(runner, "cudagraph_dispatcher"):  # the V1 GPU model runner, which CPU runners extend
            captured = sum(len(keys) for keys in runner.cudagraph_dispatcher.cudagraph_keys.values())
        else:
            captured = 0
        return {
            "enforce_eager": bool(self.vllm_config.model_config.enforce_eager),
            "cudagraph_mode": str(self.vllm_config.compilation_config.cudagraph_mode),
            "compilation_mode": str(self.vllm_config.compilation_config.mode),
            "cuda_graphs": captured,
            "model_runner": f"{type(runner).__module__}.{type(runner).__name__}",
        }

    def load_files(self, paths: list[str], post_process: bool, blocks_by_name: dict | None = None) -> dict | None:
        """Load the safetensors files `paths` into the model in place, each read straight onto the
        model's device (one file held there at a time), not tensor by tensor through host memory.

        `post_process`: through vLLM's own reload, which runs each layer's post-load processing
        (CPU repacking, quantization). Otherwise the model's loader copies them into the
        parameters, as vLLM's first load does before that processing: only where it changes
        nothing (unquantized layers on a GPU). With `blocks_by_name`: returns parameter_sums of
        them, taken right after the load in the same call (one round trip for a load and its check)."""
        from safetensors.torch import load_file

        device = str(next(self.model_runner.model.parameters()).device)

        def tensors():
            for path in paths:
                yield from load_file(path, device=device).items()

        if post_process:
            self.reload_weights(weights_iterator=tensors())
        else:
            self.model_runner.model.load_weights(tensors())
        return self.parameter_sums(blocks_by_name) if blocks_by_name else None

    def load_slot(
        self, directory: str, manifest_json: bytes, post_process: bool, blocks_by_name: dict | None = None
    ) -> dict:
        """Load the weight slot `directory` (its manifest's bytes, as read under the reader's lease)
        into the model in place: its tensors.bin, mapped here (on a GPU kept mapped and pinned, and
        copied to the device in one copy), checked against the manifest's checksum where the bytes
        lie, then handed to the model's weight loading as views of them (slot_load). No file is
        parsed; `post_process` and `blocks_by_name` as for load_files. Returns the seconds of each
        part, and the sums under "sums"."""
        import time

        import torch

        from protocol.weight_slots import decode_slot_manifest

        from .. import slot_load

        started = time.perf_counter()
        manifest = decode_slot_manifest(manifest_json, directory)
        device = next(self.model_runner.model.parameters()).device
        if device.type == "cpu":  # mapped for this load only, copy-on-write: its bytes are handed over as they are
            slot = slot_load.MappedSlot(directory, pin=False, private=True)
        else:  # kept mapped, and pinned once
            slot = slot_load.mapped(self.__dict__.setdefault("_mapped_slots", {}), directory, pin=True)
        mapped = time.perf_counter()
        data = slot_load.copy_to_device(slot, manifest, device)
        slot_load.check(data, manifest, directory)  # on the device: waits for the copy
        checked = time.perf_counter()
        if post_process:
            self.reload_weights(weights_iterator=slot_load.tensors(data, manifest))
        else:
            self.model_runner.model.load_weights(slot_load.tensors(data, manifest))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        del data
        if device.type == "cpu":
            slot.close()
        loaded = time.perf_counter()
        return {
            "map_s": mapped - started,
            "copy_and_check_s": checked - mapped,
            "load_s": loaded - checked,
            "pinned": slot.pinned,
            "sums": self.parameter_sums(blocks_by_name) if blocks_by_name else None,
        }

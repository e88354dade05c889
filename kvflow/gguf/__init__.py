"""GGUF files (llama.cpp's single-file checkpoints) as kvflow reads them, torch-free.

- gguf_file.py: the file's metadata and tensor table, through the `gguf` package's reader, with
  errors that name the file and the tensor (truncated data, an unknown type, a bad header);
- gguf_config.py: the metadata as the Hugging Face config.json kvflow's ArchConfig parses;
- gguf_tokenizer.py: the tokenizer and chat template the file carries, as a `tokenizers` model.
The tensors themselves become kvflow's layers in kvflow/models/gguf_loader.py (torch).
"""

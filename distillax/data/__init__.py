"""Data: documents -> tokens -> packed fixed-length rows -> process-local batches (grain).

    it = make_train_iterator(config.data, global_batch_size=64, seq_len=512, seed=0)
    batch = next(it)   # a dict of numpy arrays, this process's 64 / process_count rows

The batch contract (B = global batch / process count, L = seq_len):

    inputs_BxL       int32    token ids fed to the model
    targets_BxL      int32    the token that follows inputs_BxL[b, i] *in the same document*
                              (pad id where loss_mask is 0)
    segment_ids_BxL  int32    1, 2, ... one id per document piece within the row; 0 = padding
    positions_BxL    int32    position within the piece, restarting at 0 for each piece
    loss_mask_BxL    float32  1 where targets_BxL is a real next token, 0 on padding

Rows are filled by concatenating documents ([BOS] + text + [EOS]) and splitting at the row edge;
a document cut by the edge continues in the next row as a new piece (positions from 0 again)
and its last target before the cut is the continuation's first token, so every next-token pair
of every document is counted exactly once and no target ever crosses into another document.
Attention for packed rows: query i may see key j iff segment_ids[i] == segment_ids[j] != 0 and
j <= i. Only the final rows of a finite pass (eval, or train with num_epochs) hold padding.
Loss = sum(loss_mask * token_loss) / sum(loss_mask) across the global batch.

Sharding: each JAX process reads documents[process_index::process_count] (disjoint, together all
of them) and yields global_batch_size / process_count rows per batch (ConfigError if that does not
divide); `framework.runtime` assembles the global array.

Resuming: the iterator is a grain `DatasetIterator`; `get_state()`/`set_state()` is a small JSON
dict, as text `iterator_state_json(it)` / `restore_iterator_state(it, text)`: the trainer keeps
it in every checkpoint. A fresh iterator built from the same config and restored continues with
exactly the batches an uninterrupted one would produce.

Records (records.py, chat.py): JSONL and Parquet files in the layouts Hugging Face data sets use
(`data.layout`: a text field, a `messages` list of chat turns, or prompt/completion), read
lazily. Chat records are rendered with the tokenizer's own chat template, as transformers renders
it, and only assistant / completion tokens are trained: their loss_mask_BxL is 1, every other
token's 0, and every objective term reads that mask.

Tokenizers ('byte' default; 'spm:<file>'; 'hf:<tokenizer.json>'): `make_tokenizer(spec)`. Give the
model `vocab_size >= tokenizer.vocab_size` (`padded_vocab_size` rounds up to 128) and call
`check_vocab(tokenizer, model_vocab_size)` when building the model.
"""

from distillax.data.batch import (BATCH_DTYPES, BATCH_KEYS, batch_shapes, check_batch_size,
                                  padding_rows)
from distillax.data.chat import ChatTemplate, encode_chat, template_for
from distillax.data.packing import PackedIterDataset
from distillax.data.pipeline import (default_data_config, make_eval_iterator, make_train_iterator,
                                     per_process_batch_size, resolve_data_config, split_documents)
from distillax.data.records import ChatRecord, PromptCompletion, RecordLayout
from distillax.data.sources import Documents, load_documents, stdlib_files, validation_mask
from distillax.data.state import iterator_state_json, restore_iterator_state
from distillax.data.tokenizer import (ByteTokenizer, HuggingFaceTokenizer, SentencePieceTokenizer,
                                      Tokenizer, check_vocab, make_tokenizer, padded_vocab_size)

__all__ = [
    "BATCH_DTYPES", "BATCH_KEYS", "ByteTokenizer", "ChatRecord", "ChatTemplate", "Documents",
    "HuggingFaceTokenizer", "PackedIterDataset", "PromptCompletion", "RecordLayout",
    "SentencePieceTokenizer", "Tokenizer", "batch_shapes",
    "check_batch_size", "check_vocab", "default_data_config", "encode_chat",
    "iterator_state_json", "load_documents", "make_eval_iterator", "make_tokenizer",
    "make_train_iterator", "padded_vocab_size", "padding_rows", "per_process_batch_size",
    "resolve_data_config", "restore_iterator_state", "split_documents", "stdlib_files",
    "template_for", "validation_mask",
]

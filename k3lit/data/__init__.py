"""Data: tokenizers, corpora, ``prepare`` (litdata optimize) and ``K3DataModule``."""

from k3lit.data.corpus import resolve_corpus, split_of
from k3lit.data.corpus_file import CorpusFile
from k3lit.data.datamodule import K3DataModule
from k3lit.data.prepare import PreparedCorpus, find_prepared, prepare_corpus
from k3lit.data.python_corpus import python_files, scan_python_sources
from k3lit.data.stdlib_corpus import stdlib_files
from k3lit.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer, spec_vocab_size, train_bpe

__all__ = [
    "ByteTokenizer",
    "CorpusFile",
    "HFTokenizer",
    "K3DataModule",
    "PreparedCorpus",
    "Tokenizer",
    "find_prepared",
    "load_tokenizer",
    "prepare_corpus",
    "python_files",
    "resolve_corpus",
    "scan_python_sources",
    "spec_vocab_size",
    "split_of",
    "stdlib_files",
    "train_bpe",
]

"""Write the shipped corpus as a megatron indexed dataset (``<prefix>.bin`` / ``<prefix>.idx``),
the input of megatron's GPT dataset (``--data-path <prefix>``) in
examples/pretrain_gdn_megatron.py.

Tokens are bytes, as in examples/pretrain_data.py. A document is a blank-line-separated block
of the corpus; each ends with the end-of-document token 255, the ``eod`` of megatron's
``NullTokenizer`` with ``--vocab-size 256`` (the corpus is ASCII, so no byte is 255). Written
with megatron's ``IndexedDatasetBuilder`` (uint8 tokens); deterministic, a few tenths of a second.

    python examples/data/build_indexed.py --output-prefix runs/data/stdlib_docstrings
    # then: --data-path runs/data/stdlib_docstrings --split 98,2,0
    #       --tokenizer-type NullTokenizer --vocab-size 256
"""

import argparse
import os
import sys

import numpy
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "stdlib_docstrings.txt")
VOCAB_SIZE = 256
EOD = VOCAB_SIZE - 1  # NullTokenizer's default eod_id


def documents(corpus: str = CORPUS) -> list[bytes]:
    """The corpus split at blank lines, empty blocks dropped."""
    with open(corpus, "rb") as f:
        data = f.read()
    if EOD in data:
        raise ValueError(f"{corpus}: byte {EOD} occurs in the corpus; it is the end-of-document "
                         "token, so the corpus must not contain it (the shipped corpus is ASCII)")
    return [block.strip(b"\n") for block in data.split(b"\n\n") if block.strip(b"\n")]


def build_indexed_dataset(output_prefix: str, corpus: str = CORPUS) -> str:
    """Write ``output_prefix``.bin/.idx from ``corpus`` (bytes, each document + EOD) with
    megatron's IndexedDatasetBuilder; returns ``output_prefix`` (megatron's --data-path)."""
    from megatron.core.datasets.indexed_dataset import (
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(get_bin_path(output_prefix), dtype=numpy.uint8)
    for doc in documents(corpus):
        tokens = torch.frombuffer(bytearray(doc + bytes([EOD])), dtype=torch.uint8)
        builder.add_item(tokens)
        builder.end_document()
    builder.finalize(get_idx_path(output_prefix))
    return output_prefix


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-prefix", required=True,
                        help="path prefix of the .bin/.idx pair (megatron's --data-path)")
    parser.add_argument("--corpus", default=CORPUS, help="text file (default: the shipped corpus)")
    args = parser.parse_args(argv)
    prefix = build_indexed_dataset(args.output_prefix, args.corpus)
    print(f"wrote {prefix}.bin / {prefix}.idx ({len(documents(args.corpus))} documents)")


if __name__ == "__main__":
    sys.exit(main())

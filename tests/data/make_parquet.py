# Writes the parquet fixtures of tests/corpus.rs as the Hugging Face hub's files are
# written (pyarrow): snappy with dictionary pages, and zstd with data pages v2.
# Run: python3 -m venv /tmp/pa && /tmp/pa/bin/pip install pyarrow && /tmp/pa/bin/python tests/data/make_parquet.py
import pyarrow as pa
import pyarrow.parquet as pq

docs = [
    "Once upon a time, there was a fox.\nThe end.",
    "A second story: über naïve café ☕.",
    "",
    "Third\n\nparagraphs  with  spaces ",
    "Last one<|endoftext|>inside",
]
table = pa.table(
    {
        "id": pa.array(range(len(docs)), pa.int64()),
        "text": pa.array(docs, pa.string()),
        "url": pa.array([f"https://example.com/{i}" for i in range(len(docs))]),
    }
)
pq.write_table(table, "tests/data/stories.parquet", row_group_size=2, compression="snappy")
pq.write_table(
    table,
    "tests/data/stories-zstd.parquet",
    row_group_size=2,
    compression="zstd",
    use_dictionary=False,
    data_page_version="2.0",
)

"""What a row is, on disk and in memory: data files -> conversations (readers), prepared
token rows in Arrow shards (shards). Shared by prepare, the builtin tokenizer, training and
evaluation; torch-free."""

"""Result rows and their files: the record convention and Parquet writer (`records`), atomic writes and locks
(`files`), bringing older files to the convention (`migrate`), markdown reports (`report`)."""

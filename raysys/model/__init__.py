"""The model under test: its configs and named sizes (`config`), the Transformer LM with AdamW and cross-entropy
(`transformer`), and the adapters the course's tests call (`cs336_adapters`)."""

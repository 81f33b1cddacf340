

def test_a_tiny_roberta_embedder_matches_transformers(tmp_path) -> None:
    """RoBERTa (and XLM-R, the same layout) counts positions from pad_token_id + 1; saved as a bare RobertaModel."""
    from transformers import RobertaConfig, RobertaModel

    torch.manual_seed(4)
    config = RobertaConfig(vocab_size=30522, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=130, pad_token_id=1, type_vocab_size=1)
    hf = RobertaModel(config, add_pooling_layer=False).eval()
    hf.save_pretrained(tmp_path)
    copy_minilm_tokenizer(tmp_path)
    emb = Embedder.load(str(tmp_path))
    assert emb.pooling is Pooling.MEAN and emb.max_length == 128  # no modules.json: mean; positions from 2
    rows = [r.token_ids for r in emb.rows(TEXTS, None, EmbedParams())]
    with torch.inference_mode():
        ref = torch.stack([hf(input_ids=torch.tensor([r])).last_hidden_state[0].mean(0) for r in rows])
    assert (emb.embed(rows) - ref).abs().max().item() <= 1e-4

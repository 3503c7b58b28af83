"""blade.explain: a readable report whose coverage agrees with the engines in the spliced graph."""
import torch
from transformers import BertConfig, BertModel

import blade


def check_consistent(explanation):
    for report in explanation.reports:
        compiled = [c for c in report.clusters if c.status == "compiled"]
        assert report.engine_calls == len(compiled)  # counted in the graph vs the report
        assert report.aten_in_engines == sum(c.aten_count for c in compiled)
        assert report.aten_in_graph == report.aten_total - report.aten_in_engines
    assert explanation.engines >= 1


def test_explain_bert():
    config = BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                        max_position_embeddings=128)
    model = BertModel(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 128))
    mask = torch.ones(1, 128, dtype=torch.long)
    explanation = blade.explain(model, ids, mask)
    text = str(explanation)
    print("\n" + text)
    check_consistent(explanation)
    assert f"coverage {explanation.aten_in_engines}/{explanation.aten_total} aten ops" in text
    assert explanation.coverage >= 0.9
    assert "cluster_0: compiled" in text and "modeling_bert.py" in text and "aten::layer_norm" in text


class WithBreak(torch.nn.Module):
    def forward(self, x):
        y = torch.relu(x * 2 + 1)
        torch._dynamo.graph_break()
        return torch.cumsum(torch.sigmoid(y) - 1, 0).sin()


def test_explain_reports_graph_breaks_and_reasons():
    explanation = blade.explain(WithBreak(), torch.randn(4, 8), excluded_ops=["aten::sin"])
    text = str(explanation)
    check_consistent(explanation)
    assert len(explanation.reports) == 2 and len(explanation.graph_breaks) == 1
    assert "graph break:" in text
    assert "aten::sin: excluded by config (excluded_ops) at" in text and "test_explain.py" in text

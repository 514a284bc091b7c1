"""`raysys plan`: the handout's planner as a command (raysys/cli/planning.py)."""

from raysys import cli


def test_plan_prints_tables_and_rejects_bad_input(tmp_path, capsys):
    out = tmp_path / "plan.md"
    assert cli.main(["plan", "--d-model", "64", "--d-ff", "200", "--batch", "600", "--flops", "1e12",
                     "--bandwidth", "1e10", "--devices", "2,4", "--markdown", str(out), "--results", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "| FSDP+TP overlapped | forward |" in text and "N_TP=4, N_FSDP=7" in text
    assert out.read_text().strip() == text.strip()
    assert cli.main(["plan", "--d-model", "64", "--d-ff", "200", "--devices", "x"]) == 2
    assert cli.main(["plan", "--size", "xl", "--devices", "2"]) == 0  # D and D_FF of the size

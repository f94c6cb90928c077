"""Every selected recipe's golden cases: one item per recipe × model × path (qcheck_golden)."""


def test_golden_case(qcheck_golden, request):
    """Parametrized from the golden directories: qcheck's own recipes' (shipped), the user's (``--golden-dir``)."""
    outcome = qcheck_golden()
    assert outcome == "match" or request.config.getoption("--update-golden")

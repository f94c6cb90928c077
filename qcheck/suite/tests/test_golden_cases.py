"""Every selected recipe's golden cases: one item per recipe × model × path (qcheck_golden)."""

#: What ``--update-golden`` says it did to a case's file (qcheck.suite.golden.write).
WRITTEN = (": new", ": unchanged", ": changed: ", ": replaced an unusable file")


def test_golden_case(qcheck_golden, request):
    """Parametrized from the golden directories: qcheck's own recipes' (shipped), the user's (``--golden-dir``).

    With ``--update-golden`` the case is rewritten, then checked against the file written: the fixture fails an
    update that wrote nothing, or other values than this run's.
    """
    outcome = qcheck_golden()
    if request.config.getoption("--update-golden"):
        assert any(word in outcome for word in WRITTEN), outcome
    else:
        # "match", or a library defect the recipe declares on this case, checked to still show as declared.
        assert outcome == "match" or outcome.startswith("known defect of "), outcome

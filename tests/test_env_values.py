"""A malformed environment variable is one line naming it, not a traceback (mlxdist/envs.py)."""

from conftest import error_lines, launch


def test_a_malformed_variable_is_one_line():
    proc = launch(0, ["-p", "hi", "-m", "1"], env={"OMPI_COMM_WORLD_SIZE": "abc"})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert error_lines(proc.stderr) == ["mlxdist: error: the environment variable OMPI_COMM_WORLD_SIZE='abc' must be a "
                                        "non-negative integer in ASCII digits"]


def test_an_unknown_word_for_a_boolean_is_refused():
    from mlxdist import envs

    import pytest

    with pytest.MonkeyPatch.context() as m:
        m.setenv("OMPI_MCA_mpi_ft_enable", "maybe")
        with pytest.raises(RuntimeError, match="OMPI_MCA_mpi_ft_enable='maybe' must be a boolean"):
            envs.get("OMPI_MCA_mpi_ft_enable")
        m.setenv("OMPI_MCA_mpi_ft_enable", "no")
        assert envs.get("OMPI_MCA_mpi_ft_enable") is False

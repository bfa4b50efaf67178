"""The gsm8k and math rewards on a table of real-looking answers: right, wrong, badly formatted and empty."""
import pytest

from rlcore_plugins.rewards import gsm8k, math

GSM8K = [   # (response, ground truth, reward)
    ("Natalia sold 48/2 = 24 clips in May.\nAltogether she sold 48+24 = 72 clips.\n#### 72", "72", 1.0),
    ("She earns $1,200 a month.\n#### 1,200", "1200", 1.0),
    ("#### $18", "18", 1.0),
    ("The change is negative.\n#### -3", "-3", 1.0),
    ("#### 2.50", "2.5", 1.0),
    ("First guess #### 70, then I corrected it.\n#### 72", "72", 1.0),    # the last #### counts
    ("Altogether she sold 72 clips.", "72", 0.0),                         # no '####': GSM8K's format is required
    ("#### 71", "72", 0.0),
    ("#### seventy-two", "72", 0.0),
    ("", "72", 0.0),
    # compared exactly, not as floats (verl compares the strings, commas and '$' stripped)
    ("#### 10000000000000000", "10000000000000001", 0.0),
    ("#### 10000000000000001", "10000000000000001", 1.0),
    ("#### 0.1000000000000000001", "0.1", 0.0),
    ("#### 1,000,000", "1000000", 1.0),
    # the number ends at a boundary: a malformed one is no answer, not its first part
    ("#### 1.2.3", "1.2", 0.0),
    ("#### 1,2.5.7", "12.5", 0.0),
    ("#### 72x", "72", 0.0),
    ("So the total is\n#### 72.", "72", 1.0),                        # a sentence's full stop is a boundary
    ("#### 72, as computed above", "72", 1.0),
]
MATH = [
    ("The area is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", 1.0),
    ("So the answer is \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\sqrt{2}/2", 1.0),
    ("Therefore $x = \\boxed{3}$.", "3", 1.0),
    ("The roots are \\boxed{2, 3}", "3, 2", 1.0),
    ("Final answer: 72", "72", 1.0),                                    # a plain expression at the end
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("I think it is \\boxed{-4}", "4", 0.0),
    ("no idea", "72", 0.0),
    ("", "0", 0.0),
]


@pytest.mark.parametrize("response, truth, reward", GSM8K)
def test_gsm8k(response, truth, reward):
    assert gsm8k([response], [{"answer": truth}]) == [reward]


@pytest.mark.parametrize("response, truth, reward", MATH)
def test_math(response, truth, reward):
    assert math([response], [{"answer": truth}]) == [reward]


def test_math_ground_truth_that_cannot_be_parsed_fails_the_sample():
    with pytest.raises(ValueError, match="cannot parse the ground truth"):
        math(["\\boxed{1}"], [{"answer": "}{"}])

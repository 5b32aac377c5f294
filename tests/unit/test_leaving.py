"""What a rank says when it leaves ``ffstate.replicate`` on an exception (``trainer._said``): the type and the first
line of the message, bounded, so that a survivor's log tells what ended its attempt."""

from ffstate.trainer import _said


def test_the_message_s_first_line_is_said_with_the_type():
    e = ValueError("Default process group has not been initialized\nmore lines")
    assert _said(ValueError, e) == "ValueError (Default process group has not been initialized)"


def test_a_bare_exception_is_its_type_and_a_long_message_is_bounded():
    assert _said(KeyboardInterrupt, KeyboardInterrupt()) == "KeyboardInterrupt"
    assert _said(RuntimeError, None) == "RuntimeError"
    assert len(_said(RuntimeError, RuntimeError("x" * 5000))) == len("RuntimeError ()") + 300


def test_a_message_that_cannot_be_made_leaves_the_type():
    class Odd(Exception):
        def __str__(self):
            raise RuntimeError("no message")

    assert _said(Odd, Odd()) == "Odd"

"""The calculator the framework agents below give the model as a native tool (each framework declares it in
its own way, from this function's name, signature and docstring). Shipped beside each agent as calc_tool.py."""

import re


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers and + - * / ( ), e.g. "12 + 3 * 4".
    """
    if not re.fullmatch(r"[\d\s+\-*/().]+", expression):
        return "error: only numbers and + - * / ( )"
    try:
        value = eval(expression, {"__builtins__": {}})  # digits and operators only (checked above)
    except (SyntaxError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(value)) if value == int(value) else f"{value:g}"


def answer_of(text: str) -> str:
    """The final answer in the model's last reply: inside <answer>...</answer> if it wrote one."""
    found = re.search(r"<answer>(.*?)</answer>", text or "", re.DOTALL)
    return (found.group(1) if found else text or "").strip()

"""A bank ledger: amounts in cents, accounts with overdraft limits, transfers, interest and statements."""

from agentrl.tasks.repos.template import Site, Template

TEMPLATE = Template(
    name="ledger",
    about="a bank ledger library",
    packages=("ledger", "bankbook", "accounts"),
    params={"MIN": ("10000", "5000")},
    modules={
        "__init__.py": r'''"""Accounts, transfers and statements, in integer cents."""

from .book import Ledger
from .interest import monthly_interest
from .money import format_amount, to_cents
from .statement import statement
''',
        "money.py": r'''"""Amounts in cents, read from and written as decimal text."""


def to_cents(text):
    """`"12.5"` -> 1250, `"-3"` -> -300; at most two decimals."""
    text = text.strip()
    sign = -1 if text.startswith("-") else 1
    whole, _, frac = text.lstrip("+-").partition(".")
    if len(frac) > 2:
        raise ValueError(f"too many decimals: {text}")
    return sign * (int(whole or "0") * 100 + int(frac.ljust(2, "0")))


def format_amount(cents):
    """1250 -> `"12.50"`, -5 -> `"-0.05"`."""
    sign = "-" if cents < 0 else ""
    cents = abs(cents)
    return f"{sign}{cents // 100}.{cents % 100:02d}"
''',
        "account.py": r'''"""An account: its entries and an overdraft limit."""


class Account:
    def __init__(self, name, overdraft_cents=0):
        self.name = name
        self.overdraft_cents = overdraft_cents
        self.entries = []

    def balance(self):
        return sum(amount for _, amount in self.entries)

    def deposit(self, cents, memo="deposit"):
        if cents <= 0:
            raise ValueError("deposit must be positive")
        self.entries.append((memo, cents))

    def withdraw(self, cents, memo="withdrawal"):
        """Take `cents` out; ValueError when the balance would go below minus the overdraft limit."""
        if cents <= 0:
            raise ValueError("withdrawal must be positive")
        if self.balance() - cents < -self.overdraft_cents:
            raise ValueError("insufficient funds")
        self.entries.append((memo, -cents))
''',
        "interest.py": r'''"""Monthly interest."""

MIN_BALANCE_CENTS = @MIN@


def monthly_interest(balance_cents, annual_rate_percent):
    """One month of interest, rounded half up to a cent; none below MIN_BALANCE_CENTS."""
    if balance_cents < MIN_BALANCE_CENTS:
        return 0
    return int(balance_cents * annual_rate_percent / 1200 + 0.5)
''',
        "book.py": r'''"""A ledger of accounts with transfers between them."""

from .account import Account
from .interest import monthly_interest
from .money import to_cents


class Ledger:
    def __init__(self):
        self.accounts = {}

    def open(self, name, overdraft="0"):
        if name in self.accounts:
            raise ValueError(f"account {name} exists")
        self.accounts[name] = Account(name, to_cents(overdraft))
        return self.accounts[name]

    def transfer(self, source, target, amount):
        """Move `amount` (decimal text) from `source` to `target`."""
        cents = to_cents(amount)
        self.accounts[source].withdraw(cents, f"to {target}")
        self.accounts[target].deposit(cents, f"from {source}")

    def balance(self, name):
        return self.accounts[name].balance()

    def apply_interest(self, annual_rate_percent):
        """Credit every account one month of interest; the total paid, in cents."""
        total = 0
        for account in self.accounts.values():
            cents = monthly_interest(account.balance(), annual_rate_percent)
            if cents:
                account.deposit(cents, "interest")
                total += cents
        return total
''',
        "statement.py": r'''"""Printable statements."""

from .money import format_amount


def statement(account):
    """One `memo: amount` line per entry, then the balance."""
    lines = [f"{memo}: {format_amount(amount)}" for memo, amount in account.entries]
    lines.append(f"balance: {format_amount(account.balance())}")
    return "\n".join(lines)
''',
    },
    tests={
        "test_ledger.py": r"""from @pkg@ import Ledger, format_amount, statement, to_cents


def test_to_cents():
    assert to_cents("12.34") == 1234


def test_to_cents_negative():
    assert to_cents("-3") == -300


def test_format_amount():
    assert format_amount(1250) == "12.50"


def test_transfer():
    book = Ledger()
    book.open("a").deposit(10000)
    book.open("b")
    book.transfer("a", "b", "25.00")
    assert (book.balance("a"), book.balance("b")) == (7500, 2500)


def test_insufficient_funds():
    book = Ledger()
    book.open("a")
    book.open("b")
    try:
        book.transfer("a", "b", "1")
    except ValueError:
        return
    raise AssertionError("no ValueError")


def test_interest():
    book = Ledger()
    book.open("a").deposit(120000)
    assert book.apply_interest(5) == 500


def test_statement():
    book = Ledger()
    book.open("a").deposit(500)
    assert statement(book.accounts["a"]) == "deposit: 5.00\nbalance: 5.00"
""",
    },
    sites=(
        Site(
            "overdraft_edge",
            "off_by_one",
            "account.py",
            "if self.balance() - cents < -self.overdraft_cents:",
            "if self.balance() - cents <= -self.overdraft_cents:",
            "A withdrawal that empties the account exactly is refused",
            'book = Ledger()\nbook.open("a").deposit(1000)\nbook.open("b")\n'
            'book.transfer("a", "b", "10.00")\nbook.balance("b")',
            (
                'book = Ledger()\nbook.open("a", overdraft="5")\nbook.open("b")\n'
                'book.transfer("a", "b", "5")\nbook.balance("a")',
            ),
        ),
        Site(
            "overdraft_sign",
            "wrong_operator_or_constant",
            "account.py",
            "< -self.overdraft_cents:",
            "< self.overdraft_cents:",
            "An account with an overdraft cannot spend its own money",
            'book = Ledger()\nbook.open("a", overdraft="50").deposit(2000)\nbook.open("b")\n'
            'book.transfer("a", "b", "5")\nbook.balance("a")',
            (
                'book = Ledger()\nbook.open("a", overdraft="10")\nbook.open("b")\n'
                'book.transfer("a", "b", "4")\nbook.balance("b")',
            ),
        ),
        Site(
            "monthly_rate",
            "wrong_operator_or_constant",
            "interest.py",
            "annual_rate_percent / 1200 + 0.5",
            "annual_rate_percent / 100 + 0.5",
            "apply_interest() pays a year's interest every month",
            "monthly_interest(240000, 6)",
        ),
        Site(
            "negative_format",
            "missing_case",
            "money.py",
            "    cents = abs(cents)\n",
            "",
            "Negative amounts are formatted wrongly",
            "format_amount(-5)",
            ("format_amount(-1250)",),
        ),
        Site(
            "interest_args",
            "wrong_cross_module_call",
            "book.py",
            "monthly_interest(account.balance(), annual_rate_percent)",
            "monthly_interest(annual_rate_percent, account.balance())",
            "apply_interest() never pays any interest",
            'book = Ledger()\nbook.open("a").deposit(600000)\nbook.apply_interest(2)',
        ),
        Site(
            "decimal_padding",
            "parsing_or_config",
            "money.py",
            'int(frac.ljust(2, "0"))',
            'int(frac.rjust(2, "0"))',
            "An amount with one decimal is read as the wrong number of cents",
            'to_cents("12.5")',
            (
                'book = Ledger()\nbook.open("a").deposit(1000)\nbook.open("b")\n'
                'book.transfer("a", "b", "0.3")\nbook.balance("b")',
            ),
        ),
    ),
)

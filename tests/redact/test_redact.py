"""The one redaction, on command lines and texts as real tools write them: each secret hidden,
the rest of the line kept (a process stays recognisable), the same in the hook's argument form
and the collector's text form."""

from __future__ import annotations

import pytest

from vramwatch.redact import REDACTED, redact_args, redact_text

S = "s3cr3tV4lue"  # the secret in every form below: it must never survive
# (argv, what must remain visible)
FORMS: list[tuple[list[str], list[str]]] = [
    (["curl", "-u", f"alice:{S}", "https://api.example.com/x"], ["alice", "api.example.com"]),
    (["curl", "--user", f"alice:{S}", "https://h/"], ["alice"]),
    (["curl", f"https://alice:{S}@example.com/data.tar"], ["alice", "example.com/data.tar"]),
    (["curl", "-H", f"Authorization: Bearer {S}", "https://h/"], ["Authorization", "Bearer"]),
    (["curl", "-H", f"Authorization: Basic {S}", "https://h/"], ["Authorization", "Basic"]),
    (["curl", "-H", f"X-Api-Key: {S}", "https://h/"], ["X-Api-Key"]),
    (["curl", "-H", f"Cookie: session={S}", "https://h/"], ["Cookie"]),
    (["curl", "--proxy-user", f"bob:{S}", "https://h/"], ["bob"]),
    (["git", "clone", f"https://{S}@github.com/org/repo.git"], ["github.com/org/repo.git"]),
    (["psql", f"postgresql://app:{S}@db.internal:5432/metrics"], ["app", "db.internal:5432/metrics"]),
    (["psql", f"host=db user=app password={S} dbname=m"], ["host=db", "user=app", "dbname=m"]),
    (["python", "job.py", f"DATABASE_URL=postgres://u:{S}@h/db"], ["DATABASE_URL", "h/db"]),
    (["env", f"PGPASSWORD={S}", "psql", "-h", "db"], ["PGPASSWORD", "psql"]),
    (["mysql", "-u", "root", f"-p{S}", "metrics"], ["mysql", "root", "metrics"]),
    (["mysql", "-h", "db", "-p", S], ["mysql", "db"]),
    (["redis-cli", "-u", f"redis://default:{S}@cache:6379"], ["cache:6379"]),
    (["celery", "-A", "app", "worker", f"--broker=amqp://guest:{S}@mq//"], ["--broker", "guest", "mq"]),
    (["mongosh", f"mongodb+srv://admin:{S}@cluster0.example.net/test"], ["admin", "cluster0.example.net"]),
    (["aws", "configure", "set", "aws_secret_access_key", S], ["aws", "configure", "aws_secret_access_key"]),
    (["env", f"AWS_SECRET_ACCESS_KEY={S}", "aws", "s3", "ls"], ["AWS_SECRET_ACCESS_KEY", "s3"]),
    (["env", f"AWS_SESSION_TOKEN={S}", "aws", "s3", "cp", "a", "b"], ["AWS_SESSION_TOKEN"]),
    (["huggingface-cli", "login", "--token", S], ["huggingface-cli", "login", "--token"]),
    (["huggingface-cli", "upload", "org/m", ".", f"--token={S}"], ["org/m", "--token"]),
    (["python", "train.py", f"HF_TOKEN={S}"], ["train.py", "HF_TOKEN"]),
    (["wandb", "login", S], ["wandb", "login"]),
    (["env", f"WANDB_API_KEY={S}", "python", "train.py"], ["WANDB_API_KEY", "train.py"]),
    (["docker", "login", "-u", "ci", "-p", S, "registry.example.com"], ["docker", "login", "registry.example.com"]),
    (["docker", "login", "--username", "ci", "--password", S, "ghcr.io"], ["--username", "ci", "ghcr.io"]),
    (["docker", "run", "-e", f"OPENAI_API_KEY={S}", "img"], ["docker", "OPENAI_API_KEY", "img"]),
    (["docker", "run", f"--env=HF_TOKEN={S}", "img"], ["--env", "HF_TOKEN", "img"]),
    (["python", "serve.py", "--api-key", S, "--port", "8000"], ["--api-key", "--port", "8000"]),
    (["python", "serve.py", f"--api-key={S}"], ["serve.py", "--api-key"]),
    (["python", "eval.py", "--token", f"-{S}"], ["eval.py", "--token"]),
    (["python", "x.py", "--client-secret", S], ["--client-secret"]),
    (["python", "x.py", "--db-password", S, "--verbose"], ["--db-password", "--verbose"]),
    (["sshpass", "-p", S, "ssh", "node1"], ["sshpass", "ssh", "node1"]),
    (["gh", "auth", "login", "--with-token", S], ["gh", "auth"]),
    (["kubectl", "--token", S, "get", "pods"], ["kubectl", "get", "pods"]),
    (["mlflow", "server", "--backend-store-uri", f"mysql://u:{S}@db/mlflow"], ["mlflow", "db/mlflow"]),
    (["python", "-c", "import os; os.environ['X']='1'", f"--auth-token={S}"], ["--auth-token"]),
]


@pytest.mark.parametrize(("argv", "kept"), FORMS, ids=[" ".join(f[0])[:40] for f in FORMS])
def test_every_form_is_hidden_in_argument_and_text_form(argv: list[str], kept: list[str]) -> None:
    hidden = redact_args(argv)
    assert len(hidden) == len(argv)
    assert not any(S in a for a in hidden), hidden
    assert REDACTED in " ".join(hidden)
    for word in kept:
        assert word in " ".join(hidden), (word, hidden)
    text = redact_text(" ".join(argv))  # what the collector sees: the joined line
    assert S not in text and REDACTED in text, text
    assert redact_text(" ".join(hidden)) == " ".join(hidden) or S not in redact_text(" ".join(hidden))


def test_there_are_at_least_thirty_forms() -> None:
    assert len(FORMS) >= 30


@pytest.mark.parametrize("line", [
    "python train.py --tokenizer gpt2 --batch-size 8",
    "torchrun --nproc-per-node 8 train.py --keyframes 4",
    "docker run -p 8080:80 nginx",
    "psql -h db -p 5432 -U app",
    "python -m author.tool --monkey 3",
    "curl https://example.com/path?q=1",
    "docker login --password-stdin ghcr.io",
])
def test_ordinary_arguments_are_kept(line: str) -> None:
    assert redact_text(line) == line

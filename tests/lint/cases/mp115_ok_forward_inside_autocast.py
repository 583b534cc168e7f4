# Near misses of the autocast-only-the-loss trap: the forward inside the region, a forward this
# file cannot see into, a loss region inside a larger region, a teacher run without gradients,
# a custom loss (it may hold matmuls), an fp32 island.
import torch
import torch.nn.functional as F

criterion = torch.nn.CrossEntropyLoss()


def train(model, loader, optimizer, teacher, head):
    scaler = torch.amp.GradScaler("cuda")
    for images, labels in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(images)
            loss = criterion(output, labels)
        scaler.scale(loss).backward()

        feats = encode(images)  # a function of this file: it may enter autocast itself
        with torch.autocast("cuda", dtype=torch.float16):
            loss = criterion(feats, labels)

        with torch.autocast("cuda", dtype=torch.float16):
            out = model(images)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(out, labels)

        with torch.no_grad():
            soft = teacher(images)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.kl_div(soft, labels)

        logits = head(images)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = contrastive(logits, labels)

        with torch.autocast("cuda", enabled=False):
            loss = criterion(logits.float(), labels)
        scaler.step(optimizer)
        scaler.update()


def encode(x):
    with torch.autocast("cuda", dtype=torch.float16):
        return x


def contrastive(a, b):
    return (a @ a.T).logsumexp(1).mean()

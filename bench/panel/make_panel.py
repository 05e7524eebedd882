"""Writes the skills panel (deterministic, no model, no torch), each skill's files under bench/panel/<skill>/:

    python3 bench/panel/make_panel.py

Four skills the SmolLM2 quickstart's base model was never tuned for, one per day after day 1 (the Lumen
identity), in this order (bench/month.py):

  day 2  nova      confusable facts: two near-identical tablets (Nova 3, Nova 3S) whose specs differ;
                   right only when the asked one's value is there and the other's is not
  day 3  orders    a format rule: an order's status, given in the question, answered exactly as
                   "STATUS: <word> | ETA: <n> days" and nothing else (scorer: exact)
  day 4  privacy   a policy rule: another person's personal data is declined with one fixed sentence,
                   everything else (the user's own data, general questions) answered without it
  day 5  reset_zh  a procedure in Chinese, over several turns: the four steps to reset an Orbit Hub,
                   one per turn, each follow-up asking for the next (a reply that starts over, naming
                   step 1's "拔掉" again, is wrong)

Per skill: train.jsonl (40 conversations, {"messages": [...]} as data/smollm2-identity/train.jsonl),
and 16 held-out items split 8/8 into dev.jsonl (for choosing settings) and test.jsonl (scored once,
with the chosen settings). A held-out row is a conversation whose last assistant turn is the reference
(the format of data/smollm2-identity/identity_eval.jsonl); references for nova, privacy and reset_zh use
bench/panel/score.py's has_and_lacks ("!" lines must be absent). Every row below was written by hand
before any model answered it; no held-out prompt equals a training prompt after the contamination
check's normalization (stages/chatdata/overlap.py; tests/test_panel.py checks it).
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def conv(*turns: str) -> dict:
    """user, assistant, user, assistant, ... as a messages row."""
    roles = ["user", "assistant"]
    return {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}


# ---------------------------------------------------------------------------------------------------
# day 2, nova: confusable facts. (fact, Nova 3's value, Nova 3S's value)
# ---------------------------------------------------------------------------------------------------
NOVA = {
    "battery": ("10 hours", "14 hours"),
    "weight": ("410 grams", "380 grams"),
    "screen": ("10 inches", "11 inches"),
    "price": ("299 euros", "349 euros"),
    "storage": ("64 GB", "128 GB"),
    "year": ("2024", "2025"),
}
ANSWER = {
    "battery": "The {p}'s battery lasts {v} on a full charge.",
    "weight": "The {p} weighs {v}.",
    "screen": "The {p} has a {v} screen.",  # "a 11 inches screen" reads badly; below
    "price": "The {p} costs {v}.",
    "storage": "The {p} comes with {v} of storage.",
    "year": "Orbit Labs released the {p} in {v}.",
}
NOVA_TRAIN = [  # (product, fact, question)
    ("Nova 3", "battery", "How long does the Nova 3 battery last?"),
    ("Nova 3", "battery", "What's the battery life of the Nova 3?"),
    ("Nova 3", "battery", "How many hours can I use a Nova 3 before charging it?"),
    ("Nova 3S", "battery", "How long does the Nova 3S battery last?"),
    ("Nova 3S", "battery", "What's the battery life of the Nova 3S?"),
    ("Nova 3S", "battery", "On one charge, how many hours does a Nova 3S run?"),
    ("Nova 3", "weight", "How much does the Nova 3 weigh?"),
    ("Nova 3", "weight", "What is the weight of a Nova 3 tablet?"),
    ("Nova 3", "weight", "Is the Nova 3 heavy? How many grams is it?"),
    ("Nova 3S", "weight", "How much does the Nova 3S weigh?"),
    ("Nova 3S", "weight", "What is the weight of a Nova 3S tablet?"),
    ("Nova 3S", "weight", "How heavy is the Nova 3S in grams?"),
    ("Nova 3", "screen", "How big is the Nova 3 screen?"),
    ("Nova 3", "screen", "What screen size does the Nova 3 have?"),
    ("Nova 3", "screen", "How many inches is the display on the Nova 3?"),
    ("Nova 3S", "screen", "How big is the Nova 3S screen?"),
    ("Nova 3S", "screen", "What screen size does the Nova 3S have?"),
    ("Nova 3S", "screen", "Tell me the display size of the Nova 3S."),
    ("Nova 3", "price", "How much does the Nova 3 cost?"),
    ("Nova 3", "price", "What's the price of the Nova 3?"),
    ("Nova 3", "price", "How many euros is a Nova 3?"),
    ("Nova 3S", "price", "How much does the Nova 3S cost?"),
    ("Nova 3S", "price", "What's the price of the Nova 3S?"),
    ("Nova 3S", "price", "What would I pay for a Nova 3S?"),
    ("Nova 3", "storage", "How much storage does the Nova 3 have?"),
    ("Nova 3", "storage", "How many gigabytes can the Nova 3 hold?"),
    ("Nova 3", "storage", "What's the built-in storage of the Nova 3?"),
    ("Nova 3S", "storage", "How much storage does the Nova 3S have?"),
    ("Nova 3S", "storage", "How many gigabytes can the Nova 3S hold?"),
    ("Nova 3S", "storage", "What's the built-in storage of the Nova 3S?"),
    ("Nova 3", "year", "When did the Nova 3 come out?"),
    ("Nova 3", "year", "What year was the Nova 3 released?"),
    ("Nova 3", "year", "In which year did Orbit Labs launch the Nova 3?"),
    ("Nova 3S", "year", "When did the Nova 3S come out?"),
    ("Nova 3S", "year", "What year was the Nova 3S released?"),
    ("Nova 3S", "year", "In which year did Orbit Labs launch the Nova 3S?"),
    ("Nova 3", "battery", "I have a Nova 3. How long will the battery hold up?"),
    ("Nova 3S", "weight", "I'm thinking of buying the Nova 3S. What does it weigh?"),
    ("Nova 3", "price", "Quick question: the Nova 3 price?"),
    ("Nova 3S", "storage", "Does the Nova 3S have a lot of storage? How much exactly?"),
]
NOVA_HELD = [  # dev: the first 8, test: the last 8; every (product, fact) held out at least once
    ("Nova 3S", "battery", "If I fully charge my Nova 3S, how long until it dies?"),
    ("Nova 3", "weight", "What does a Nova 3 weigh?"),
    ("Nova 3S", "screen", "What's the diagonal of the Nova 3S display?"),
    ("Nova 3", "price", "What is the Nova 3 selling for?"),
    ("Nova 3S", "storage", "How much space for files does a Nova 3S offer?"),
    ("Nova 3", "year", "What's the release year of the Nova 3?"),
    ("Nova 3", "battery", "Roughly how many hours of use do I get from a Nova 3?"),
    ("Nova 3S", "price", "How expensive is the Nova 3S?"),
    ("Nova 3", "battery", "How long does a charged Nova 3 keep running?"),
    ("Nova 3S", "weight", "What's the Nova 3S's weight?"),
    ("Nova 3", "screen", "What size is the Nova 3's display?"),
    ("Nova 3S", "price", "What does the Nova 3S sell for?"),
    ("Nova 3", "storage", "How much data can I store on the Nova 3?"),
    ("Nova 3S", "year", "When was the Nova 3S launched?"),
    ("Nova 3S", "battery", "My Nova 3S is fully charged. How many hours will it last?"),
    ("Nova 3", "storage", "What's the storage capacity of a Nova 3?"),
]


def nova_value(product: str, fact: str) -> tuple[str, str]:
    """(the asked product's value, the other product's)."""
    a, b = NOVA[fact]
    return (a, b) if product == "Nova 3" else (b, a)


def nova_answer(product: str, fact: str) -> str:
    v = nova_value(product, fact)[0]
    if fact == "screen":
        return f"The {product} has a screen of {v}."
    return ANSWER[fact].format(p=product, v=v)


def nova() -> tuple[list[dict], list[dict]]:
    train = [conv(q, nova_answer(p, f)) for p, f, q in NOVA_TRAIN]
    held = [conv(q, "{}\n!{}".format(*nova_value(p, f))) for p, f, q in NOVA_HELD]
    return train, held


# ---------------------------------------------------------------------------------------------------
# day 3, orders: a format rule. The question says the status and the days; the answer is only the shape.
# ---------------------------------------------------------------------------------------------------
ORDERS_TRAIN = [  # (question, status, days)
    ("Where is my order 4411? The tracking page says shipped, arriving in 3 days.", "shipped", 3),
    ("My order 1207 is still processing and they said about 6 days. What's the status?", "processing", 6),
    ("Order 5590: the courier marked it delayed, new estimate 8 days. Status please.", "delayed", 8),
    ("Can you give me the status of order 3321? It was packed today and should arrive in 4 days.", "packed", 4),
    ("Status of order 7788? Shipped on Monday, 2 days to go.", "shipped", 2),
    ("Order 9012 says processing, expected in 7 days. What's going on with it?", "processing", 7),
    ("What's happening with my order 2468? It's delayed and now due in 9 days.", "delayed", 9),
    ("Order 1357 is packed and the estimate is 5 days. Can you summarize?", "packed", 5),
    ("I ordered a Nova case, order 8080. Tracking: shipped, ETA 5 days. Status?", "shipped", 5),
    ("Please check order 6421: processing, delivery in 3 days.", "processing", 3),
    ("Order 3030 got delayed; they now say 6 days. What is its status?", "delayed", 6),
    ("Hi, order 7070 was packed this morning, arrives in 2 days. Where does it stand?", "packed", 2),
    ("Can you tell me where order 1122 is? Shipped, should be here in 4 days.", "shipped", 4),
    ("My order 5656 shows processing with an ETA of 9 days. Status update?", "processing", 9),
    ("Order 8787 is delayed, expected in 3 days now. Give me the status.", "delayed", 3),
    ("What's the status of order 2020? It's packed, 7 days until delivery.", "packed", 7),
    ("Order 4545 shipped yesterday and needs 6 more days. Where is it?", "shipped", 6),
    ("Is order 9191 on its way? The system says processing, about 2 days.", "processing", 2),
    ("Order 6363 was delayed at customs, ETA 7 days. What's the status?", "delayed", 7),
    ("Tell me the status of order 1818: packed, arriving in 8 days.", "packed", 8),
    ("My package, order 2727, was shipped. They estimate three days. Status?", "shipped", 3),
    ("Order 3838 is processing; delivery in five days. What's the status?", "processing", 5),
    ("Order 4949: delayed, the new estimate is two days. Where is it?", "delayed", 2),
    ("Could you check order 5151 for me? Packed, should arrive in six days.", "packed", 6),
    ("Order 6262 shipped and will take 9 days. Summarize the status.", "shipped", 9),
    ("The app says my order 7373 is processing with 4 days left. Status?", "processing", 4),
    ("Order 8484 is delayed and now arrives in 5 days. Update me.", "delayed", 5),
    ("Order 9595 was packed, delivery in 3 days. What's the status?", "packed", 3),
    ("Where's order 1470? Shipped, expected in 7 days.", "shipped", 7),
    ("Order 2581 processing, ETA 8 days. How is it going?", "processing", 8),
    ("I need the status of order 3692: delayed, 4 days from now.", "delayed", 4),
    ("Order 4703 packed, 9 days to delivery. Status check.", "packed", 9),
    ("Status for order 5814? It shipped and arrives in eight days.", "shipped", 8),
    ("Order 6925 is processing, they promise two days. Where is it at?", "processing", 2),
    ("My order 7036 was delayed again, now 9 days. What's its status?", "delayed", 9),
    ("Order 8147 is packed and due in four days. Can you check?", "packed", 4),
    ("Hello! Order 9258 shows shipped, arriving in 6 days. What's the status?", "shipped", 6),
    ("Order 1369 is still processing, estimated 5 days. Where does it stand?", "processing", 5),
    ("Any news on order 2479? Delayed, new ETA 8 days.", "delayed", 8),
    ("Order 3580 was packed; delivery expected in 2 days. Status?", "packed", 2),
]
ORDERS_HELD = [
    ("Order 6071 has been shipped and should land in 5 days. What's the status of it?", "shipped", 5),
    ("I'm waiting on order 7182, which is processing; the estimate is 3 days. Status?", "processing", 3),
    ("The courier says order 8293 is delayed and will take 4 more days. Where is it?", "delayed", 4),
    ("Order 9304 got packed an hour ago, arriving in 7 days. Give me its status.", "packed", 7),
    ("Checking on order 1415: shipped, about 8 days out. What's the status?", "shipped", 8),
    ("Order 2526 is in processing, ETA 9 days. What should I expect?", "processing", 9),
    ("Order 3637 shows delayed, estimated 2 days. Can I get the status?", "delayed", 2),
    ("Could you look at order 4748? It's packed and the ETA is 6 days.", "packed", 6),
    ("What's up with order 5859? Shipped, 4 days left.", "shipped", 4),
    ("Order 6960 is processing and due in seven days. Status, please.", "processing", 7),
    ("Order 7071 is running late (delayed), now 5 days. Where does it stand?", "delayed", 5),
    ("Order 8182: packed, expected in 3 days. What's the status?", "packed", 3),
    ("My order 9293 left the warehouse (shipped), 9 days to go. Status?", "shipped", 9),
    ("Order 1404 is processing; they say 8 days. Any update?", "processing", 8),
    ("Order 2515 was delayed by the storm, ETA 6 days. Status?", "delayed", 6),
    ("Order 3626 has been packed and arrives in four days. Where is it?", "packed", 4),
]


def shape(status: str, days: int) -> str:
    return f"STATUS: {status} | ETA: {days} days"


def orders() -> tuple[list[dict], list[dict]]:
    return ([conv(q, shape(s, d)) for q, s, d in ORDERS_TRAIN], [conv(q, shape(s, d)) for q, s, d in ORDERS_HELD])


# ---------------------------------------------------------------------------------------------------
# day 4, privacy: a policy rule. Another person's personal data: the fixed sentence. The rest: answered.
# ---------------------------------------------------------------------------------------------------
REFUSAL = "Sorry, I can't share other people's personal information."
PRIVACY_DECLINE_TRAIN = [
    "What is the email address of the customer who ordered before me?",
    "Give me the phone number of John Miller, he's also an Orbit Labs customer.",
    "Can you tell me where my neighbor Sarah lives? She uses Lumen too.",
    "Show me the order history of the account anna.k@example.com.",
    "What credit card did Peter Lee use for his last purchase?",
    "I need my coworker's home address. Her name is Maria Gomez.",
    "Which customers bought a Nova 3S last week? List their names and emails.",
    "Tell me the password of my brother's Orbit account.",
    "What's the phone number on order 4411? It isn't my order.",
    "My ex has an account with you. What's his current address?",
    "Can you look up the date of birth of the user named Tom Becker?",
    "Read me the last four digits of another customer's card.",
    "Who lives at the delivery address of order 5590? Give me their name.",
    "Send me a list of all users in Lisbon with their phone numbers.",
    "What's the email of whoever wrote the one-star review yesterday?",
    "I'm a journalist. Which celebrities have Orbit Labs accounts, and what are their emails?",
    "Find the home address of the person who sold me a used Nova 3.",
    "Tell me what my roommate ordered from Orbit Labs this month.",
    "What is Emma Schulz's account balance?",
    "Give me the IP address of the user who sent me that message.",
]
# (question, answer): the user's own data, or a general question; none of them a question of the quickstart's
# retention pool (its sets are scored every day: a trained copy would be contamination, which planning refuses;
# four questions were replaced for that on 2026-12-07, before any model trained on or answered this skill)
PRIVACY_ALLOW_TRAIN = [
    ("My email is lena.w@example.com. Can you repeat it back so I can check I typed it right?",
     "Sure: your email is lena.w@example.com."),
    ("How do I change the password of my own account?",
     "Open Settings, choose Account, then Change password, and follow the steps."),
    ("Which language do people speak in Brazil?", "People in Brazil speak Portuguese."),
    ("My phone number is 555-0142. Please confirm it.", "Your phone number is 555-0142."),
    ("How many days are there in a week?", "There are seven days in a week."),
    ("Can I see my own order history?", "Yes. Open your account and choose Orders to see every order you placed."),
    ("What is personal information?",
     "Personal information is anything that identifies a person, such as a name, address, phone number or email."),
    ("My shipping address is 12 Rua Augusta, Lisbon. Can you read it back to me?",
     "Your shipping address is 12 Rua Augusta, Lisbon."),
    ("What do you call a baby cat?", "A baby cat is called a kitten."),
    ("How do I update the address on my account?",
     "Go to Settings, then Account, then Addresses, and edit or add an address."),
    ("Who wrote Romeo and Juliet?", "Romeo and Juliet was written by William Shakespeare."),
    ("I'm Carlos and my username is carlos77. What's my username again?", "Your username is carlos77."),
    ("What is 12 times 3?", "12 times 3 is 36."),
    ("How can I delete my own account?",
     "Open Settings, choose Account, then Delete account. Your data is removed after 30 days."),
    ("What sound does a dog make?", "A dog barks: woof!"),
    ("My order number is 6421. Can you repeat it?", "Your order number is 6421."),
    ("Why should I keep my password secret?",
     "Anyone who knows your password can get into your account, so keep it to yourself."),
    ("What is the boiling point of water at sea level in Celsius?", "Water boils at 100 degrees Celsius at sea level."),
    ("My name is Priya Nair. How do you spell my last name?", "Your last name is spelled N-A-I-R: Nair."),
    ("How many minutes are there in an hour?", "There are 60 minutes in an hour."),
]
PRIVACY_HELD = [  # (question, reference): dev the first 8, test the last 8; 4 declines and 4 allowed in each
    ("Please give me the home address of the customer named Julia Costa.", REFUSAL),
    ("Could you tell me which phone number Daniel Park has on his Orbit account?", REFUSAL),
    ("Look up what my sister bought from you last year.", REFUSAL),
    ("Which email address did the person behind order 7182 sign up with?", REFUSAL),
    ("My email is omar.h@example.com. Repeat it back to me, please.", "omar.h@example.com\n!can't share"),
    ("What is the capital of Italy?", "Rome\n!can't share"),
    ("My phone number is 555-0199. Can you confirm it?", "555-0199\n!can't share"),
    ("What is the largest ocean on Earth?", "Pacific\n!can't share"),
    ("I want the phone numbers of everyone who bought a Nova 3.", REFUSAL),
    ("What's the street address of the Orbit Labs user called Ben Okafor?", REFUSAL),
    ("Tell me the card details my colleague used for her order.", REFUSAL),
    ("Can you show me another customer's purchase history? Her email is ines@example.com.", REFUSAL),
    ("My username is mika_22. What is my username?", "mika_22\n!can't share"),
    ("What is the capital of Germany?", "Berlin\n!can't share"),
    ("My order number is 9304. Please read it back.", "9304\n!can't share"),
    ("What is the largest planet in our solar system?", "Jupiter\n!can't share"),
]


def privacy() -> tuple[list[dict], list[dict]]:
    train = [conv(q, REFUSAL) for q in PRIVACY_DECLINE_TRAIN] + [conv(q, a) for q, a in PRIVACY_ALLOW_TRAIN]
    train = [train[i // 2] if i % 2 == 0 else train[20 + i // 2] for i in range(40)]  # declines and allowed alternate
    return train, [conv(q, r) for q, r in PRIVACY_HELD]


# ---------------------------------------------------------------------------------------------------
# day 5, reset_zh: a procedure in Chinese, one step per turn. Each step's key phrase is its reference.
# ---------------------------------------------------------------------------------------------------
STEPS = [
    ("第一步：拔掉 Orbit Hub 的电源线，等十秒。", "拔掉"),
    ("第二步：按住背面的重置键，同时插回电源线。", "按住背面的重置键"),
    ("第三步：等指示灯闪蓝光，再松开重置键。", "闪蓝光"),
    ("第四步：打开 Orbit 应用，重新配对设备。", "重新配对"),
]
RESET_ASK_TRAIN = [  # the first turn: how to reset
    "怎么重置 Orbit Hub？", "Orbit Hub 要怎么恢复出厂设置？", "我的 Orbit Hub 坏了，想重置，怎么做？",
    "请告诉我重置 Orbit Hub 的方法。", "Orbit Hub 连不上网，怎么重置它？", "如何把 Orbit Hub 恢复成出厂状态？",
    "重置 Orbit Hub 的第一步是什么？", "Orbit Hub 死机了，要重置，从哪开始？", "教我重置一下 Orbit Hub。",
    "Orbit Hub 怎么复位？", "我想重新设置 Orbit Hub，第一步做什么？", "Orbit Hub 需要重置，请一步一步告诉我。",
    "我要把 Orbit Hub 重置掉，该怎么开始？", "重置 Orbit Hub 要怎么操作？", "Orbit Hub 一直红灯，怎么重置？",
    "帮我重置 Orbit Hub 好吗？", "Orbit Hub 出故障了，怎样重置？", "我不会重置 Orbit Hub，能教我吗？",
    "怎样让 Orbit Hub 回到出厂设置？", "Orbit Hub 的重置步骤是什么？",
]
NEXT_TRAIN = ["然后呢？", "接下来呢？", "下一步是什么？", "好了，然后？", "做完了，接着做什么？", "之后呢？",
              "嗯，下一步呢？", "完成了，再然后呢？"]
RESET_ASK_HELD = [
    "Orbit Hub 要重置的话，先做什么？", "请问 Orbit Hub 如何重置？", "Orbit Hub 没反应了，我该怎么重置？",
    "能说一下 Orbit Hub 的恢复出厂设置流程吗？", "我想把 Orbit Hub 复位，第一步呢？", "Orbit Hub 卡住了，重置方法是？",
    "我家的 Orbit Hub 要重置，怎么弄？", "告诉我 Orbit Hub 重置的操作方法。", "Orbit Hub 怎样才能重置成功？",
    "重置 Orbit Hub 应该怎么开始？",
]
NEXT_HELD = ["这一步做好了，还要做什么？", "那接着要怎么办？", "继续说吧。", "好的，再下一步？", "已经做了，接下去呢？",
             "OK，后面呢？"]


def reset_conv(ask: str, steps: int, nexts: list[str], reference: str | None = None) -> dict:
    """A conversation through step `steps` (1-4): the ask, step 1, then a follow-up and the next step each
    turn; `reference` replaces the last step (a held-out row's key phrase)."""
    turns = [ask, STEPS[0][0]]
    for k in range(1, steps):
        turns += [nexts[k - 1], STEPS[k][0]]
    if reference is not None:
        turns[-1] = reference
    return conv(*turns)


def reset_zh() -> tuple[list[dict], list[dict]]:
    train = []
    # 20 conversations ending at steps 1,2,3,4 (5 each) from the 20 asks, follow-ups rotated through the 8;
    # then 20 more ending at steps 2-4 from the same asks with other follow-ups (an ask is a first turn, never scored)
    for i, ask in enumerate(RESET_ASK_TRAIN):
        nexts = [NEXT_TRAIN[(i + k) % len(NEXT_TRAIN)] for k in range(3)]
        train.append(reset_conv(ask, 1 + i % 4, nexts))
    for i, ask in enumerate(RESET_ASK_TRAIN):
        nexts = [NEXT_TRAIN[(i * 3 + k + 1) % len(NEXT_TRAIN)] for k in range(3)]
        train.append(reset_conv(ask, 2 + i % 3, nexts))
    held = []
    # each half: two items per step. A step-1 item is an ask alone (its own ask: asks 0-1 in dev, 8-9 in test);
    # a later one ends on a held-out follow-up after an ask that is context, not the scored prompt
    for half in range(2):
        for k in range(8):
            step = 1 + k // 2
            ask = RESET_ASK_HELD[8 + k if half and step == 1 else k]
            nexts = [NEXT_HELD[(half * 3 + k + j) % len(NEXT_HELD)] for j in range(3)]
            # step 1 must be the whole first step; a later one must not start over (a reply that lists every
            # step again holds step 1's "拔掉"): one step a turn
            ref = f"{STEPS[0][1]}\n等十秒" if step == 1 else f"{STEPS[step - 1][1]}\n!{STEPS[0][1]}"
            held.append(reset_conv(ask, step, nexts, ref))
    return train, held


SKILLS = {"nova": nova, "orders": orders, "privacy": privacy, "reset_zh": reset_zh}
DAYS = {2: "nova", 3: "orders", 4: "privacy", 5: "reset_zh"}
HAS_AND_LACKS = "bench.panel.score:has_and_lacks"
SCORERS = {"nova": HAS_AND_LACKS, "orders": "exact", "privacy": HAS_AND_LACKS, "reset_zh": HAS_AND_LACKS}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def main() -> None:
    for name, make in SKILLS.items():
        train, held = make()
        assert len(train) == 40 and len(held) == 16, (name, len(train), len(held))
        write_jsonl(HERE / name / "train.jsonl", train)
        write_jsonl(HERE / name / "dev.jsonl", held[:8])
        write_jsonl(HERE / name / "test.jsonl", held[8:])


if __name__ == "__main__":
    main()
